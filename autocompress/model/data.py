"""Calibration text: documents split by document (calibration / selection / report, and a held-out test split), sampled as windows.

The documents of a source are shuffled with `data.seed` and split by document, so no document feeds
two splits: `calib` ranks the prunable units and drives the search, `select` picks among candidates
(Pareto fronts, the Optuna objective, compare's trial, Minitron's top-k), and `report` gives every KL
and perplexity that is printed or compared (so reported numbers carry no winner's curse); `test` (`data.test_share`,
the last documents of calibration's order, so the calibration windows read before them do not change) is read by
the headline benchmark only, which reports on text no default was chosen on. Each split
is a set of `seq_len`-token windows, one per document at a random offset (up to
`data.windows_per_document` per document when a split has too few documents); documents shorter than
a window are concatenated with EOS between them before windowing.
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autocompress.config.schema import DataSpec
from autocompress.errors import ConfigError

SPLITS: tuple[str, ...] = ("calib", "select", "report")  # what every command reads
TEST = "test"  # held out: benchmarks/headline.py asks for it by name


@dataclass
class TokenData:
    calib: torch.Tensor  # [n_calib, seq_len] token ids: importance ranking and search
    select: torch.Tensor  # [n_select, seq_len]: choosing among candidates (Pareto front, Optuna, compare's pick)
    report: torch.Tensor  # [n_report, seq_len]: every KL / perplexity printed or compared
    test: torch.Tensor | None = None  # [n_test, seq_len]: the headline's KL / perplexity (loaded only when asked for)
    documents: dict[str, list[int]] = field(default_factory=dict)  # split -> corpus indices of the documents its windows came from
    split_documents: dict[str, int] = field(default_factory=dict)  # split -> documents the split was given
    split_tokens: dict[str, int] = field(default_factory=dict)  # split -> tokens of the documents it read

    def summary(self) -> str:
        """One line: windows, documents used and tokens read per split."""
        parts = []
        for name in (*SPLITS, TEST):
            rows = getattr(self, name)
            if rows is not None and len(rows):
                parts.append(
                    f"{name} {len(rows)} x {rows.shape[1]} tokens from {len(self.documents.get(name, []))} of "
                    f"{self.split_documents.get(name, 0)} documents ({self.split_tokens.get(name, 0):,} tokens read)"
                )
        return "; ".join(parts)


def stdlib_documents() -> list[str]:
    """Paths of the Python standard library's own source files (every machine with Python has them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "idlelib", "lib2to3", "__pycache__")
    files = [p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)]
    return sorted(str(p) for p in files)


def _read_text_files(path: Path) -> list[str]:
    if path.is_dir():
        return sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".md", ".py"))
    return [str(path)]


def _jsonl_documents(path: Path, field_name: str) -> list[str]:
    """The `field_name` of every JSON line of `path`, or of every *.jsonl file in folder `path` (sorted by name)."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"data.path={str(path)!r} is a folder without *.jsonl files; point it at a jsonl file or a folder of them")
    docs = []
    for file in files:
        try:
            lines = file.read_bytes().decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            bad = file.read_bytes()[: exc.start].count(b"\n") + 1
            raise ConfigError(f"{file}:{bad} is not UTF-8 text ({exc.reason}); data.source=jsonl reads UTF-8 JSON lines") from exc
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise ConfigError(f"{file}:{n} is not a JSON object ({exc}); data.source=jsonl needs one per line") from exc
                if not isinstance(row, dict) or field_name not in row:
                    what = "is not a JSON object" if not isinstance(row, dict) else f"has no field {field_name!r}"
                    raise ConfigError(f"{file}:{n} {what}; data.source=jsonl needs one object per line with the text in data.field")
                docs.append(str(row[field_name]))
    return docs


def _documents(spec: DataSpec) -> tuple[list[str], bool]:
    """Document texts, or file paths read lazily (then the flag is True), of the configured source."""
    if spec.source == "stdlib":
        return stdlib_documents(), True
    if spec.source == "hf":
        return _hf_documents(spec), False
    path = Path(str(spec.path))
    if not path.exists():
        raise ConfigError(f"data.path={spec.path!r} does not exist; point it at a text file, a folder or a jsonl file")
    if spec.source == "text":
        files = _read_text_files(path)
        if not files:
            raise ConfigError(
                f"data.path={spec.path!r} is a folder without .txt, .md or .py files; point it at a text file or a folder of them"
            )
        if len(files) > 1:
            return files, True
        text = Path(files[0]).read_text(encoding="utf-8", errors="replace") if files else ""
        return [chunk for chunk in text.split("\n\n") if chunk.strip()], False  # paragraphs as documents
    return _jsonl_documents(path, spec.field), False


def _hf_documents(spec: DataSpec) -> list[str]:
    import datasets

    try:
        ds: Any = datasets.load_dataset(str(spec.path), spec.hf_config, split=spec.hf_split)
    except Exception as exc:
        raise ConfigError(f"data.path={spec.path!r} could not be loaded with datasets ({exc})") from exc
    if spec.field not in ds.column_names:
        raise ConfigError(f"dataset {spec.path!r} has no column {spec.field!r}; set data.field")
    return [str(t) for t in ds[spec.field]]


def _read(doc: str, is_file: bool) -> str:
    return Path(doc).read_text(encoding="utf-8", errors="replace") if is_file else doc


def split_documents(n_docs: int, spec: DataSpec) -> dict[str, list[int]]:
    """Corpus indices of each split's documents, in a seeded random order; disjoint by construction.

    Depends only on the number of documents, the seed and the shares (not on seq_len or the
    sequence counts), so every tool that reads the same source sees the same three document sets.
    """
    order = list(range(n_docs))
    random.Random(spec.seed).shuffle(order)
    n_select, n_report = round(n_docs * spec.select_share), round(n_docs * spec.report_share)
    n_test = round(n_docs * spec.test_share)
    for name, n in (("select", n_select), ("report", n_report), ("calib", n_docs - n_select - n_report - n_test)):
        if n < 1:
            raise ConfigError(
                f"the source has {n_docs} document(s): the {name} split gets none (data.select_share={spec.select_share}, "
                f"data.report_share={spec.report_share}); give more documents or change the shares"
            )
    calib = order[n_select + n_report : n_docs - n_test]  # the test documents come last: calibration reads them never
    return {"select": order[:n_select], "report": order[n_select : n_select + n_report], "calib": calib, "test": order[n_docs - n_test :]}


def _layout(n_tokens: int, seq_len: int, k: int, rng: random.Random) -> list[int]:
    """`k` non-overlapping window offsets at random positions in a document of `n_tokens` tokens, in random order."""
    slack = n_tokens - k * seq_len
    cuts = sorted(rng.randint(0, slack) for _ in range(k))
    offsets = [cut + i * seq_len for i, cut in enumerate(cuts)]
    rng.shuffle(offsets)
    return offsets


def _windows(
    docs: list[str],
    order: list[int],
    is_file: bool,
    tokenizer: Any,
    n: int,
    spec: DataSpec,
    name: str,
    sample_seed: int = 0,
    wants: str = "",
) -> tuple[torch.Tensor, list[int], int]:
    """`n` windows of `spec.seq_len` tokens from the documents `order` (corpus indices), spread across as many documents as possible.

    Pass 1 takes one window per document, at a random offset; documents shorter than a window are
    concatenated (EOS between them) and windowed together. While windows are missing, later passes
    take one more non-overlapping window from each document long enough, up to
    `spec.windows_per_document`. A non-zero `sample_seed` takes the split's documents in another order
    and other offsets (the same split, other windows). `wants`: the settings that set `n` and the window
    length when they are not data.* ones (a distillation's), for the error. Returns (windows, corpus
    indices of the documents used, tokens read).
    """
    seq_len = spec.seq_len
    rng = random.Random(f"{spec.seed}:{name}" if sample_seed == 0 else f"{spec.seed}:{name}:{sample_seed}")
    if sample_seed != 0:
        order = list(order)
        rng.shuffle(order)
    eos = getattr(tokenizer, "eos_token_id", None)
    rows: list[list[int]] = []
    used: set[int] = set()
    long_docs: list[tuple[int, list[int], list[int]]] = []  # (corpus index, ids, remaining offsets)
    pending: list[int] = []
    pending_docs: list[int] = []
    read = 0
    for index in order:
        if len(rows) >= n:
            break
        ids = tokenizer.encode(_read(docs[index], is_file), add_special_tokens=False)
        if eos is not None:
            ids.append(int(eos))
        read += len(ids)
        if len(ids) >= seq_len:
            k = min(spec.windows_per_document, len(ids) // seq_len)
            offsets = _layout(len(ids), seq_len, k, rng)
            rows.append(ids[offsets[0] : offsets[0] + seq_len])
            used.add(index)
            long_docs.append((index, ids, offsets[1:]))
            continue
        pending.extend(ids)
        pending_docs.append(index)
        if len(pending) >= seq_len:
            start = rng.randint(0, len(pending) - seq_len)
            rows.append(pending[start : start + seq_len])
            used.update(pending_docs)
            pending, pending_docs = [], []
    while len(rows) < n and any(rest for _, _, rest in long_docs):
        for index, ids, rest in long_docs:
            if len(rows) >= n:
                break
            if rest:
                offset = rest.pop()
                rows.append(ids[offset : offset + seq_len])
                used.add(index)
    if len(rows) < n:
        share = "lower data.select_share / data.report_share" if name == "calib" else f"raise data.{name}_share"
        # short documents are windowed together in the order read, so a seed's count can differ a little from seed 0's
        seeded = f" for distillation seed {sample_seed}" if sample_seed else ""
        need = (
            f"{n} are needed ({wants}); lower those"
            if wants
            else f"data.{name}_sequences={n} are needed; lower data.{name}_sequences or data.seq_len"
        )
        raise ConfigError(
            f"the {name} split ({len(order)} documents, {read:,} tokens) yields only {len(rows)} windows of {seq_len} tokens{seeded} "
            f"(at most {spec.windows_per_document} per document), {need}, raise data.windows_per_document, {share}, or give more text"
        )
    return torch.tensor(rows[:n], dtype=torch.long).view(n, seq_len), sorted(used), read


def load_token_data(
    spec: DataSpec, tokenizer: Any, splits: Collection[str] = SPLITS, calib_seed: int = 0, calib_wants: str = ""
) -> TokenData:
    """Calibration, selection and report windows from three disjoint document sets.

    `splits`: which splits to tokenise; the others come back empty ([0, seq_len]). The document
    split itself is always the same, so e.g. distillation's report windows share no document with
    its calibration windows nor with a sweep's selection windows. `calib_seed` (0: the windows every
    tool shares) draws other calibration windows from the same calibration documents: a distillation
    seed; the selection and report windows do not change with it. `calib_wants` names the settings that
    set the calibration count and length when a caller derives them (a distillation), for the error.
    """
    unknown = sorted(set(splits) - {*SPLITS, TEST})
    if unknown:
        raise ValueError(f"unknown split(s) {unknown}; use {(*SPLITS, TEST)}")
    docs, is_file = _documents(spec)
    parts = split_documents(len(docs), spec)
    if TEST in splits and not parts[TEST]:
        raise ConfigError(f"the source has {len(docs)} document(s): the test split gets none (data.test_share={spec.test_share}); raise it")
    counts = {"calib": spec.calib_sequences, "select": spec.select_sequences, "report": spec.report_sequences, TEST: spec.test_sequences}

    def empty() -> torch.Tensor:
        return torch.zeros(0, spec.seq_len, dtype=torch.long)

    data = TokenData(calib=empty(), select=empty(), report=empty())
    for name in (*SPLITS, TEST):
        data.split_documents[name] = len(parts[name])
        if name in splits:
            seed = calib_seed if name == "calib" else 0
            wants = calib_wants if name == "calib" else ""
            rows, used, read = _windows(docs, parts[name], is_file, tokenizer, counts[name], spec, name, seed, wants)
            setattr(data, name, rows)
            data.documents[name], data.split_tokens[name] = used, read
    return data
