"""DeciLM (nemotron-nas) checkpoints of heterogeneous architectures that transformers and vLLM load.

`configuration_decilm.py` and `modeling_decilm.py` are self-contained (no autocompress imports):
`write_checkpoint` copies them into the checkpoint and names them in `config.json`'s `auto_map`, so
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` and
`vllm.LLM(dir, trust_remote_code=True)` both load it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from autocompress.arch.space import Architecture
from autocompress.errors import ConfigError
from autocompress.io import write_dir

HERE = Path(__file__).resolve().parent
CODE_FILES = ("configuration_decilm.py", "modeling_decilm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_decilm.DeciLMConfig",
    "AutoModel": "modeling_decilm.DeciLMModel",
    "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM",
}
# base-model settings carried over unchanged (the shapes come from the architecture)
INHERITED = (
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def decilm_config(arch: Architecture, base_config: Any) -> Any:
    """The DeciLMConfig of `arch`, with the base model's activation, norm, RoPE and special tokens."""
    from autocompress.model.decilm.configuration_decilm import DeciLMConfig

    inherited = {key: getattr(base_config, key) for key in INHERITED if getattr(base_config, key, None) is not None}
    blocks = arch.block_configs()
    for block in blocks:  # vLLM never reads replace_with_linear; keep the config to what it reads
        for part in block.values():
            part.pop("replace_with_linear", None)
    config = DeciLMConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        head_dim=arch.head_dim,
        tie_word_embeddings=arch.tie_word_embeddings,
        block_configs=blocks,
        **inherited,
    )
    config.architectures = ["DeciLMForCausalLM"]
    config.auto_map = dict(AUTO_MAP)
    return config


def parameter_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a DeciLM checkpoint of `arch` stores (Llama names, no biases)."""
    d, q, hd = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, d), "model.norm.weight": (d,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, d)
    for i, b in enumerate(arch.blocks):
        p = f"model.layers.{i}."
        if b.kv_heads:
            shapes[p + "input_layernorm.weight"] = (d,)
            shapes[p + "self_attn.q_proj.weight"] = (q, d)
            shapes[p + "self_attn.k_proj.weight"] = shapes[p + "self_attn.v_proj.weight"] = (b.kv_heads * hd, d)
            shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if b.ffn:
            shapes[p + "post_attention_layernorm.weight"] = (d,)
            shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (b.ffn, d)
            shapes[p + "mlp.down_proj.weight"] = (d, b.ffn)
    return shapes


def check_state_dict(arch: Architecture, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise ConfigError naming every missing, unexpected or mis-shaped tensor."""
    expected = parameter_shapes(arch)
    problems = [f"missing {k}" for k in expected if k not in state_dict]
    problems += [f"unexpected {k}" for k in state_dict if k not in expected]
    problems += [
        f"{k} has shape {tuple(v.shape)}, expected {expected[k]}"
        for k, v in state_dict.items()
        if k in expected and tuple(v.shape) != expected[k]
    ]
    if problems:
        raise ConfigError("state_dict does not match the architecture: " + "; ".join(problems[:8]))


def vllm_limitation(arch: Architecture) -> str | None:
    """Why vLLM 0.32's `DeciLMForCausalLM` cannot serve `arch` (None if it can).

    Its decoder layer passes `residual=None` to a fused add-norm when the first layer that computes
    anything has a no-op attention, and it takes the KV-head count from the first attention layer.
    """
    if not any(b.kv_heads for b in arch.blocks):
        return "it has no attention layer (vLLM takes the KV-head count from the first attention layer)"
    first = next(b for b in arch.blocks if b.kv_heads or b.ffn)
    if not first.kv_heads:
        idx = arch.blocks.index(first)
        return f"layer {idx}, the first layer that computes anything, has a no-op attention and a kept FFN (vLLM 0.32 fails on it)"
    return None


def write_checkpoint(arch: Architecture, out_dir: Path, base_config: Any, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a DeciLM checkpoint of `arch` to `out_dir` (absent or empty) atomically; return `out_dir`.

    Always: config.json (with `auto_map`) and the configuration/modeling code. With `state_dict`
    (Llama names, see `parameter_shapes`): model.safetensors too. Without it the folder serves with
    vLLM's `load_format="dummy"`. No tokenizer: pass one to the engine separately.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir} exists and is not an empty folder; choose a new output folder or remove it")
    config = decilm_config(arch, base_config)
    if state_dict is not None:
        check_state_dict(arch, state_dict)
        config.dtype = next(iter(state_dict.values())).dtype

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        for name in CODE_FILES:
            shutil.copyfile(HERE / name, tmp / name)
        if state_dict is not None:
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(tmp / "model.safetensors"), {"format": "pt"})

    write_dir(out_dir, fill)
    return out_dir


__all__ = ["check_state_dict", "decilm_config", "parameter_shapes", "vllm_limitation", "write_checkpoint"]
