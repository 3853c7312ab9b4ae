"""Load a checkpoint folder (an export, a distilled model, any Llama-family model) or the configured base model, with a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autocompress.config.schema import ModelSpec
from autocompress.errors import ConfigError
from autocompress.model.base import check_model_folder, has_tokenizer, load_base_model

BASE = "base"  # the name that means "the configured base model" on command lines


@dataclass
class Loaded:
    model: Any  # fp32, eval mode
    tokenizer: Any
    name: str  # what tables call it
    path: str | None  # checkpoint folder (None for the in-process tiny model)


def load_checkpoint(path: str | Path, base: ModelSpec) -> Loaded:
    """`path` = a checkpoint folder (or hub id), or `base` for the configured base model.

    A folder without tokenizer files (exports of the tiny test model) uses the base model's tokenizer.
    DeciLM checkpoints carry their own code (`trust_remote_code`).
    """
    if str(path) == BASE:
        loaded = load_base_model(base)
        return Loaded(loaded.model, loaded.tokenizer, base.name, loaded.path)
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.exists() and (str(path).startswith((".", "/")) or folder.suffix):
        raise ConfigError(f"checkpoint {path} does not exist; give an exported or distilled model folder (or `base`)")
    check_model_folder(path, "checkpoint", families=None, tokenizer=False)
    model = open_model(path)
    own = not folder.exists() or has_tokenizer(folder)
    tokenizer = (
        AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)  # our exports' DeciLM config: never ask on stdin
        if own
        else load_base_model(base).tokenizer
    )
    check_vocabulary(model, tokenizer, f"checkpoint {path}", "its own tokenizer" if own else f"model={base.name}'s tokenizer")
    model.eval()
    return Loaded(model, tokenizer, folder.name or str(path), str(path))


def open_model(path: str | Path) -> Any:
    """The float32 model at `path` (a folder or hub id); ConfigError naming the folder if it cannot be loaded (missing or corrupt files)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32)
    except Exception as exc:  # OSError, ValueError, JSONDecodeError, SafetensorError: a damaged or foreign folder
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(
            f"{path} could not be loaded as a model ({type(exc).__name__}: {first}); give a checkpoint folder with config.json "
            "and weights, e.g. export it again with python -m autocompress.export"
        ) from exc


def tokenizer_size(tokenizer: Any) -> int:
    """How many token ids `tokenizer` can emit (a ByteTokenizer: 256)."""
    return len(tokenizer) if hasattr(tokenizer, "__len__") else 256


def check_vocabulary(model: Any, tokenizer: Any, name: str, whose: str) -> None:
    """A tokenizer whose ids the model's embedding cannot hold would end in an IndexError deep in the forward pass."""
    vocab, size = int(model.config.vocab_size), tokenizer_size(tokenizer)
    if size > vocab:
        raise ConfigError(
            f"{name} has a vocabulary of {vocab:,} tokens but {whose} emits {size:,}: they are not the same model's; "
            "name the model it was pruned from with model=NAME (or model=hf model.path=DIR)"
        )
