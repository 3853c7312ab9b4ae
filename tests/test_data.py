"""Calibration data: sources, the three-way split by document, windows spread across documents, clear errors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from autocompress.config.build import build
from autocompress.config.schema import DataSpec
from autocompress.errors import ConfigError
from autocompress.model.base import ByteTokenizer
from autocompress.model.data import SPLITS, load_token_data, split_documents, stdlib_documents

C4 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "corpora" / "c4_sample"
EOS = 0


class WordTokenizer:
    """Token id = 1 + position in a vocabulary of words: doc i is `d{i}w0 d{i}w1 ...`, so every id names its document and position."""

    eos_token_id = EOS

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.vocab) + 1
                self.words[self.vocab[word]] = word
            ids.append(self.vocab[word])
        return ids

    def doc_and_position(self, token: int) -> tuple[int, int]:
        doc, pos = self.words[token][1:].split("w")
        return int(doc), int(pos)


def synthetic(tmp_path: Path, n_docs: int = 200, lengths: tuple[int, ...] = (40, 90, 150)) -> Path:
    """A jsonl corpus of `n_docs` distinct documents of varied lengths (in words = tokens)."""
    path = tmp_path / "docs.jsonl"
    rows = [json.dumps({"text": " ".join(f"d{i}w{j}" for j in range(lengths[i % len(lengths)]))}) for i in range(n_docs)]
    path.write_text("\n".join(rows) + "\n")
    return path


def spec(path: Path, **kw: object) -> DataSpec:
    base: dict[str, object] = dict(source="jsonl", path=str(path), seq_len=32, calib_sequences=40, select_sequences=12, report_sequences=12)
    return DataSpec(**{**base, **kw})  # type: ignore[arg-type]


def window_docs(tok: WordTokenizer, rows: object) -> list[set[int]]:
    """Per window, the documents its tokens come from (EOS excluded)."""
    return [{tok.doc_and_position(int(t))[0] for t in row if int(t) != EOS} for row in rows]  # type: ignore[attr-defined]


def test_splits_are_disjoint_by_document_and_span_many_documents(tmp_path: Path) -> None:
    tok = WordTokenizer()
    data = load_token_data(spec(synthetic(tmp_path)), tok)
    assert (data.calib.shape, data.select.shape, data.report.shape) == ((40, 32), (12, 32), (12, 32))
    seen = {name: set().union(*window_docs(tok, getattr(data, name))) for name in SPLITS}
    assert not seen["calib"] & seen["select"] and not seen["calib"] & seen["report"] and not seen["select"] & seen["report"]
    assert len(seen["calib"]) >= 35 and len(seen["select"]) >= 10 and len(seen["report"]) >= 10  # one window per document
    assert all(seen[name] <= set(data.documents[name]) for name in SPLITS)  # the recorded provenance covers what is in the windows
    parts = split_documents(200, spec(synthetic(tmp_path)))
    assert (len(parts["select"]), len(parts["report"]), len(parts["calib"]), len(parts["test"])) == (20, 20, 140, 20)
    assert "calib 40 x 32 tokens from" in data.summary() and data.test is None  # the test split is read only when asked for


def test_test_split_is_held_out_and_leaves_the_other_windows_as_they_were(tmp_path: Path) -> None:
    """The headline's test split: its own documents; select and report unchanged, calibration's windows too (its
    documents come last in calibration's order, beyond what the calibration windows read)."""
    tok, path = WordTokenizer(), synthetic(tmp_path)
    with_test = load_token_data(dataclasses.replace(spec(path), test_sequences=8), tok, splits=(*SPLITS, "test"))
    without = load_token_data(dataclasses.replace(spec(path), test_share=0.0), tok)
    assert with_test.test is not None and with_test.test.shape == (8, 32)
    for name in SPLITS:
        assert torch.equal(getattr(with_test, name), getattr(without, name)), name
    test_docs = set().union(*window_docs(tok, with_test.test))
    for name in SPLITS:
        assert not test_docs & set().union(*window_docs(tok, getattr(with_test, name))), name
    with pytest.raises(ConfigError, match="test split gets none"):
        load_token_data(dataclasses.replace(spec(path), test_share=0.0), tok, splits=("test",))


def test_windows_sit_at_random_offsets(tmp_path: Path) -> None:
    tok = WordTokenizer()
    data = load_token_data(spec(synthetic(tmp_path, lengths=(150,))), tok)
    starts = [tok.doc_and_position(int(row[0]))[1] for row in data.calib]
    assert len(set(starts)) > 10 and sum(s == 0 for s in starts) < len(starts) / 4


def test_a_split_short_of_documents_takes_a_few_windows_per_document(tmp_path: Path) -> None:
    tok = WordTokenizer()
    data = load_token_data(spec(synthetic(tmp_path, n_docs=50, lengths=(150,)), select_sequences=15, windows_per_document=3), tok)
    docs = [d for ds in window_docs(tok, data.select) for d in ds]
    assert len(set(docs)) == 5 and max(docs.count(d) for d in set(docs)) == 3  # 5 select documents, at most 3 windows each
    with pytest.raises(ConfigError, match=r"the select split .* data\.select_sequences=16 are needed; lower data\.select_sequences"):
        load_token_data(spec(synthetic(tmp_path, n_docs=50, lengths=(150,)), select_sequences=16, windows_per_document=3), tok)


def test_short_documents_are_concatenated(tmp_path: Path) -> None:
    tok = WordTokenizer()
    data = load_token_data(spec(synthetic(tmp_path, lengths=(10,)), calib_sequences=8, select_sequences=4, report_sequences=4), tok)
    assert all(len(d) >= 3 for d in window_docs(tok, data.calib))  # 11 tokens per document (EOS included): three or more per window
    assert (data.calib == EOS).sum() >= 8 * 2


def test_deterministic_for_a_seed_and_different_for_another(tmp_path: Path) -> None:
    path = synthetic(tmp_path)
    a, b = load_token_data(spec(path), WordTokenizer()), load_token_data(spec(path), WordTokenizer())
    assert all((getattr(a, n) == getattr(b, n)).all() for n in SPLITS) and a.documents == b.documents
    c = load_token_data(spec(path, seed=1), WordTokenizer())
    assert c.documents["select"] != a.documents["select"] and c.documents["report"] != a.documents["report"]
    assert split_documents(200, spec(path)) != split_documents(200, spec(path, seed=1))


def test_the_document_split_does_not_depend_on_window_sizes(tmp_path: Path) -> None:
    path = synthetic(tmp_path)
    assert split_documents(200, spec(path)) == split_documents(200, spec(path, seq_len=64, calib_sequences=3))
    only = load_token_data(spec(path), WordTokenizer(), splits=("calib", "report"))
    assert only.select.shape == (0, 32) and only.report.shape == (12, 32)


def test_jsonl_folder_reads_every_file(tmp_path: Path) -> None:
    tok = WordTokenizer()
    for part in range(2):
        (tmp_path / f"part{part}.jsonl").write_text(
            "\n".join(json.dumps({"text": " ".join(f"d{100 * part + i}w{j}" for j in range(40))}) for i in range(100))
        )
    data = load_token_data(spec(tmp_path), tok)
    docs = set().union(*window_docs(tok, data.calib))
    assert any(d < 100 for d in docs) and any(d >= 100 for d in docs)
    assert sum(data.split_documents.values()) == 200


def test_stdlib_is_the_default_corpus() -> None:
    docs = stdlib_documents()
    assert len(docs) > 100 and all(d.endswith(".py") for d in docs)
    small = DataSpec(seq_len=32, calib_sequences=6, select_sequences=3, report_sequences=3)
    data = load_token_data(small, ByteTokenizer())
    assert data.calib.shape == (6, 32) and data.select.shape == (3, 32) and data.report.shape == (3, 32)
    assert len(data.documents["calib"]) == 6  # one window per file
    again = load_token_data(small, ByteTokenizer())
    assert (data.calib == again.calib).all() and (data.report == again.report).all()  # fixed seed


def test_text_file_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(30)))
    data = load_token_data(
        DataSpec(source="text", path=str(path), seq_len=32, calib_sequences=4, select_sequences=2, report_sequences=2), ByteTokenizer()
    )
    assert data.calib.shape == (4, 32)
    with pytest.raises(ConfigError, match=r"lower data\.calib_sequences"):
        load_token_data(DataSpec(source="text", path=str(path), seq_len=512, calib_sequences=400), ByteTokenizer())
    with pytest.raises(ConfigError, match=r"512 tokens for distillation seed 2 .*lower data\.calib_sequences"):
        load_token_data(DataSpec(source="text", path=str(path), seq_len=512, calib_sequences=400), ByteTokenizer(), calib_seed=2)
    with pytest.raises(ConfigError, match=r"the report split gets none .*data\.report_share"):
        load_token_data(DataSpec(source="text", path=str(path), report_share=0.01), ByteTokenizer())
    with pytest.raises(ConfigError, match="does not exist"):
        load_token_data(DataSpec(source="text", path=str(tmp_path / "missing.txt")), ByteTokenizer())
    with pytest.raises(ConfigError, match="has no field"):
        (tmp_path / "x.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
        load_token_data(DataSpec(source="jsonl", path=str(tmp_path / "x.jsonl")), ByteTokenizer())
    with pytest.raises(ConfigError, match=r"without \*\.jsonl"):
        (tmp_path / "empty").mkdir()
        load_token_data(DataSpec(source="jsonl", path=str(tmp_path / "empty")), ByteTokenizer())
    with pytest.raises(ConfigError, match=r"data\.path is required"):
        DataSpec(source="jsonl")


def test_config_keys_fail_fast() -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) data\.heldout_sequences; known: .*report_sequences.*select_sequences"):
        build(DataSpec, {"heldout_sequences": 8}, "data")
    with pytest.raises(ConfigError, match=r"data\.select_share \+ data\.report_share \(\+ data\.test_share\) = 1 leaves no calibration"):
        DataSpec(select_share=0.45, report_share=0.45)
    with pytest.raises(ConfigError, match=r"data\.report_share must be in \(0, 1\)"):
        DataSpec(report_share=0)
    with pytest.raises(ConfigError, match=r"data\.windows_per_document must be > 0"):
        DataSpec(windows_per_document=0)


@pytest.mark.skipif(not C4.is_dir(), reason=f"{C4} is absent (shared evaluation data)")
def test_c4_sample_folder_at_the_defaults() -> None:
    data = load_token_data(DataSpec(source="jsonl", path=str(C4)), ByteTokenizer())
    assert sum(data.split_documents.values()) == 2000
    assert (data.split_documents["select"], data.split_documents["report"]) == (200, 200)
    for name in SPLITS:
        rows = getattr(data, name)
        assert len(data.documents[name]) >= 0.9 * len(rows)  # about one document per window
    assert not set(data.documents["calib"]) & set(data.documents["select"])
    assert not set(data.documents["select"]) & set(data.documents["report"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "a"}\nnot json\n', r"bad\.jsonl:2 is not a JSON object"),
        (b'{"text": "a"}\n42\n', r"bad\.jsonl:2 is not a JSON object; .*data\.field"),
        (b'{"text": "a"}\n{"text": "caf\xe9"}\n', r"bad\.jsonl:2 is not UTF-8 text"),
        (b'{"body": "a"}\n', r"bad\.jsonl:1 has no field 'text'; .*data\.field"),
    ],
    ids=["not-json", "bare-number", "not-utf8", "no-field"],
)
def test_bad_jsonl_names_file_and_line(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_token_data(DataSpec(source="jsonl", path=str(tmp_path / "bad.jsonl")), ByteTokenizer())
    with pytest.raises(ConfigError, match=message):  # a folder of jsonl files names the bad one too
        load_token_data(DataSpec(source="jsonl", path=str(tmp_path)), ByteTokenizer())


def test_text_folder_without_text_files(tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_bytes(b"\0")
    with pytest.raises(ConfigError, match=r"without \.txt, \.md or \.py files"):
        load_token_data(DataSpec(source="text", path=str(tmp_path)), ByteTokenizer())


def test_a_calibration_seed_draws_other_windows_from_the_same_documents(tmp_path: Path) -> None:
    """A distillation seed (calib_seed) changes the calibration windows only, within the calibration documents."""
    path = synthetic(tmp_path)
    t0, t1 = WordTokenizer(), WordTokenizer()
    a, b = load_token_data(spec(path), t0), load_token_data(spec(path), t1, calib_seed=1)
    words = lambda tok, rows: [[tok.words.get(int(t), "eos") for t in row] for row in rows]  # noqa: E731
    assert words(t0, a.calib) != words(t1, b.calib) and a.documents["calib"] != b.documents["calib"]
    assert set(b.documents["calib"]) <= set(split_documents(200, spec(path))["calib"])  # still only calibration documents
    for name in ("select", "report"):  # what picks and what is reported do not move with the seed
        assert words(t0, getattr(a, name)) == words(t1, getattr(b, name)) and a.documents[name] == b.documents[name]
    tc = WordTokenizer()
    c = load_token_data(spec(path), tc, calib_seed=0)
    joined = " ".join(" ".join(row) for row in words(tc, c.calib))
    # seed 0: the windows every tool shares, the same as before seeds existed (digest taken at commit d31260d)
    assert hashlib.sha256(joined.encode()).hexdigest()[:16] == "89fb6be645db2679"
