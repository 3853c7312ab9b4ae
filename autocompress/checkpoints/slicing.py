"""Slicing the base model's weights to a searched architecture, in the importance order the search used, and writing them.

Hidden channels keep the top-ranked ones (embedding, norms, every projection, LM head), FFN neurons the top-ranked per
layer, query heads the top-ranked of every KV group per layer (Q rows and O columns, in their original order), and KV
heads are mean-pooled within groups of consecutive heads, exactly as `arch.masking.MaskedModel` computes them; no-op
blocks have no weights. Heterogeneous architectures become DeciLM (nemotron-nas) checkpoints, homogeneous ones plain Llama.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from autocompress.arch.masking import Ranking
from autocompress.arch.space import Architecture
from autocompress.errors import ConfigError
from autocompress.model.decilm import write_checkpoint


def merge_heads(weight: torch.Tensor, base_kv: int, kept: int) -> torch.Tensor:
    """[base_kv*hd, d] K or V projection -> [kept*hd, d], each kept head the mean of its group."""
    hd = weight.shape[0] // base_kv
    return weight.view(kept, base_kv // kept, hd, -1).mean(dim=1).reshape(kept * hd, -1)


def sliced_layers(model: Any, arch: Architecture, ranking: Ranking) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(global tensors, per-layer tensors) of the pruned model; a no-op block contributes no tensors."""
    keep = torch.sort(ranking.hidden[: arch.hidden_size]).values
    inner = model.model
    base_kv, nq = model.config.num_key_value_heads, model.config.num_attention_heads
    glob = {"embed": inner.embed_tokens.weight[:, keep], "norm": inner.norm.weight[keep]}
    if not arch.tie_word_embeddings:
        glob["lm_head"] = model.lm_head.weight[:, keep]
    layers = []
    for idx, (layer, block) in enumerate(zip(inner.layers, arch.blocks, strict=True)):
        out: dict[str, torch.Tensor] = {}
        att = layer.self_attn
        if block.kv_heads:
            heads = ranking.kept_heads(idx, nq, base_kv, arch.num_attention_heads)
            hd = att.q_proj.weight.shape[0] // nq
            q_rows = (heads[:, None] * hd + torch.arange(hd)).flatten()  # channels of the kept query heads
            out["input_norm"] = layer.input_layernorm.weight[keep]
            out["q"] = att.q_proj.weight[q_rows][:, keep]
            out["k"] = merge_heads(att.k_proj.weight, base_kv, block.kv_heads)[:, keep]
            out["v"] = merge_heads(att.v_proj.weight, base_kv, block.kv_heads)[:, keep]
            out["o"] = att.o_proj.weight[keep][:, q_rows]
        if block.ffn:
            neurons = torch.sort(ranking.ffn[idx][: block.ffn]).values
            mlp = layer.mlp
            out["post_norm"] = layer.post_attention_layernorm.weight[keep]
            out["gate"] = mlp.gate_proj.weight[neurons][:, keep]
            out["up"] = mlp.up_proj.weight[neurons][:, keep]
            out["down"] = mlp.down_proj.weight[keep][:, neurons]
        layers.append(out)
    return glob, layers


LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}


def pruned_state_dict(model: Any, arch: Architecture, ranking: Ranking) -> dict[str, torch.Tensor]:
    """The pruned weights under Llama's parameter names (which DeciLM and vLLM read too); no tied LM head."""
    glob, layers = sliced_layers(model, arch, ranking)
    state = {"model.embed_tokens.weight": glob["embed"], "model.norm.weight": glob["norm"]}
    if "lm_head" in glob:
        state["lm_head.weight"] = glob["lm_head"]
    for idx, tensors in enumerate(layers):
        state |= {f"model.layers.{idx}.{LAYER_NAMES[key]}": t for key, t in tensors.items()}
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def llama_config(base_config: Any, arch: Architecture) -> Any:
    """The LlamaConfig of a homogeneous architecture without no-op blocks; ConfigError if Llama cannot express it."""
    from transformers import LlamaConfig

    block = arch.blocks[0]
    if not arch.is_homogeneous() or not block.kv_heads or not block.ffn:
        raise ConfigError("only homogeneous architectures without no-op blocks export as plain Llama")
    if arch.hidden_size % arch.num_attention_heads:
        raise ConfigError(
            f"transformers' LlamaConfig needs hidden_size % num_attention_heads == 0 ({arch.hidden_size}, {arch.num_attention_heads})"
        )
    raw = base_config.to_dict()
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "_name_or_path",
        "architectures",
        "dtype",
    ):
        raw.pop(key, None)
    config = LlamaConfig(
        **raw,
        hidden_size=arch.hidden_size,
        intermediate_size=block.ffn,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=block.kv_heads,
        head_dim=arch.head_dim,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def checkpoint_format(arch: Architecture) -> str:
    """'llama' when a plain Llama checkpoint expresses `arch` (homogeneous, no no-op, hidden % heads == 0), else 'decilm'."""
    block = arch.blocks[0]
    plain = arch.is_homogeneous() and block.kv_heads and block.ffn and arch.hidden_size % arch.num_attention_heads == 0
    return "llama" if plain else "decilm"


def to_llama(model: Any, arch: Architecture, ranking: Ranking) -> Any:
    """A plain LlamaForCausalLM with the pruned weights of a homogeneous architecture (no no-op blocks)."""
    from transformers import LlamaForCausalLM

    pruned = LlamaForCausalLM(llama_config(model.config, arch)).to(model.dtype)
    missing, unexpected = pruned.load_state_dict(pruned_state_dict(model, arch, ranking), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    pruned.tie_weights()
    return pruned.eval()


def write_weights(model: Any, arch: Architecture, ranking: Ranking, out_dir: Path) -> str:
    """Write config + model.safetensors of the pruned model to `out_dir` (absent); return the format written."""
    state = pruned_state_dict(model, arch, ranking)
    fmt = checkpoint_format(arch)
    if fmt == "decilm":
        write_checkpoint(arch, out_dir, model.config, state)
        return fmt
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True)
    config = llama_config(model.config, arch)
    config.dtype = model.dtype
    config.save_pretrained(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), {"format": "pt"})
    return fmt
