"""Calibration data: sources, disjoint calibration / held-out split, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autocompress.config import DataSpec
from autocompress.data import load_token_data, stdlib_documents
from autocompress.errors import ConfigError
from autocompress.models import ByteTokenizer


def test_stdlib_is_the_default_corpus() -> None:
    docs = stdlib_documents()
    assert len(docs) > 100 and all(d.endswith(".py") for d in docs)
    data = load_token_data(DataSpec(seq_len=32, calib_sequences=6, heldout_sequences=3), ByteTokenizer())
    assert data.calib.shape == (6, 32) and data.heldout.shape == (3, 32)
    again = load_token_data(DataSpec(seq_len=32, calib_sequences=6, heldout_sequences=3), ByteTokenizer())
    assert (data.calib == again.calib).all()  # fixed seed


def test_jsonl_split_is_disjoint(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"document {i} " + chr(65 + i % 26) * 40}) for i in range(20)))
    data = load_token_data(
        DataSpec(source="jsonl", path=str(path), field="body", seq_len=16, calib_sequences=4, heldout_sequences=2), ByteTokenizer()
    )
    calib = {bytes(r.tolist()) for r in data.calib}
    held = {bytes(r.tolist()) for r in data.heldout}
    assert not calib & held


def test_text_file_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(30)))
    data = load_token_data(DataSpec(source="text", path=str(path), seq_len=32, calib_sequences=4, heldout_sequences=2), ByteTokenizer())
    assert data.calib.shape == (4, 32)
    with pytest.raises(ConfigError, match=r"lower data\.calib_sequences"):
        load_token_data(DataSpec(source="text", path=str(path), seq_len=512, calib_sequences=400, heldout_sequences=2), ByteTokenizer())
    with pytest.raises(ConfigError, match="does not exist"):
        load_token_data(DataSpec(source="text", path=str(tmp_path / "missing.txt")), ByteTokenizer())
    with pytest.raises(ConfigError, match="has no field"):
        (tmp_path / "x.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
        load_token_data(DataSpec(source="jsonl", path=str(tmp_path / "x.jsonl")), ByteTokenizer())
    with pytest.raises(ConfigError, match=r"data\.path is required"):
        DataSpec(source="jsonl")
