"""Calibration text: documents from a source, tokenised into fixed-length calibration and held-out sequences.

Documents are shuffled with a fixed seed and split before tokenisation, so calibration and held-out
sequences never come from the same document.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autocompress.config import DataSpec
from autocompress.errors import ConfigError

HELDOUT_SHARE = 0.2  # share of documents reserved for held-out sequences


@dataclass
class TokenData:
    calib: torch.Tensor  # [n_calib, seq_len] token ids
    heldout: torch.Tensor  # [n_heldout, seq_len]


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
        if len(files) > 1:
            return files, True
        text = Path(files[0]).read_text(encoding="utf-8", errors="replace") if files else ""
        return [chunk for chunk in text.split("\n\n") if chunk.strip()], False  # paragraphs as documents
    docs = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                row = json.loads(line)
                if spec.field not in row:
                    raise ConfigError(f"{path}:{n} has no field {spec.field!r}; set data.field")
                docs.append(str(row[spec.field]))
    return docs, False


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


def _pack(docs: list[str], is_file: bool, tokenizer: Any, n: int, seq_len: int, what: str) -> torch.Tensor:
    """Concatenate tokenised documents (EOS between them) and cut `n` sequences of `seq_len` tokens."""
    need, ids = n * seq_len, []
    eos = getattr(tokenizer, "eos_token_id", None)
    for doc in docs:
        ids.extend(tokenizer.encode(_read(doc, is_file), add_special_tokens=False))
        if eos is not None:
            ids.append(int(eos))
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ConfigError(
            f"the calibration source holds only {len(ids)} tokens for the {what} split, {need} are needed "
            f"({n} x {seq_len}); lower data.{what}_sequences or data.seq_len, or give more text"
        )
    return torch.tensor(ids[:need], dtype=torch.long).view(n, seq_len)


def load_token_data(spec: DataSpec, tokenizer: Any) -> TokenData:
    """Calibration and held-out token sequences from disjoint documents."""
    docs, is_file = _documents(spec)
    if len(docs) < 2:
        raise ConfigError(f"data source {spec.source!r} has {len(docs)} document(s); at least 2 are needed to split")
    random.Random(spec.seed).shuffle(docs)
    cut = max(1, int(len(docs) * HELDOUT_SHARE))
    heldout_docs, calib_docs = docs[:cut], docs[cut:]
    return TokenData(
        calib=_pack(calib_docs, is_file, tokenizer, spec.calib_sequences, spec.seq_len, "calib"),
        heldout=_pack(heldout_docs, is_file, tokenizer, spec.heldout_sequences, spec.seq_len, "heldout"),
    )
