"""Pruned weights for a chosen architecture, sliced in the importance order the search used.

Hidden channels keep the top-ranked ones (embedding, norms, every projection, LM head), FFN neurons
the top-ranked per layer, and KV heads are mean-pooled within groups of consecutive heads, exactly
as `masking.MaskedModel` computes them.
"""

from __future__ import annotations

from typing import Any

import torch

from autocompress.arch import Architecture
from autocompress.errors import ConfigError
from autocompress.masking import Ranking


def merge_heads(weight: torch.Tensor, base_kv: int, kept: int) -> torch.Tensor:
    """[base_kv*hd, d] K or V projection -> [kept*hd, d], each kept head the mean of its group."""
    hd = weight.shape[0] // base_kv
    return weight.view(kept, base_kv // kept, hd, -1).mean(dim=1).reshape(kept * hd, -1)


def sliced_layers(model: Any, arch: Architecture, ranking: Ranking) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(global tensors, per-layer tensors) of the pruned model; a no-op block contributes no tensors."""
    keep = torch.sort(ranking.hidden[: arch.hidden_size]).values
    inner = model.model
    base_kv = model.config.num_key_value_heads
    glob = {"embed": inner.embed_tokens.weight[:, keep], "norm": inner.norm.weight[keep]}
    if not arch.tie_word_embeddings:
        glob["lm_head"] = model.lm_head.weight[:, keep]
    layers = []
    for idx, (layer, block) in enumerate(zip(inner.layers, arch.blocks, strict=True)):
        out: dict[str, torch.Tensor] = {}
        att = layer.self_attn
        if block.kv_heads:
            out["input_norm"] = layer.input_layernorm.weight[keep]
            out["q"] = att.q_proj.weight[:, keep]
            out["k"] = merge_heads(att.k_proj.weight, base_kv, block.kv_heads)[:, keep]
            out["v"] = merge_heads(att.v_proj.weight, base_kv, block.kv_heads)[:, keep]
            out["o"] = att.o_proj.weight[keep, :]
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


def to_llama(model: Any, arch: Architecture, ranking: Ranking) -> Any:
    """A plain LlamaForCausalLM with the pruned weights of a homogeneous architecture (no no-op blocks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    block = arch.blocks[0]
    if not arch.is_homogeneous() or not block.kv_heads or not block.ffn:
        raise ConfigError("only homogeneous architectures without no-op blocks export as plain Llama")
    raw = model.config.to_dict()
    for key in ("hidden_size", "intermediate_size", "num_key_value_heads", "head_dim", "_name_or_path"):
        raw.pop(key, None)
    config = LlamaConfig(
        **raw, hidden_size=arch.hidden_size, intermediate_size=block.ffn, num_key_value_heads=block.kv_heads, head_dim=arch.head_dim
    )
    pruned = LlamaForCausalLM(config).to(model.dtype)
    glob, layers = sliced_layers(model, arch, ranking)
    with torch.no_grad():
        pruned.model.embed_tokens.weight.copy_(glob["embed"])
        pruned.model.norm.weight.copy_(glob["norm"])
        if "lm_head" in glob:
            pruned.lm_head.weight.copy_(glob["lm_head"])
        for layer, w in zip(pruned.model.layers, layers, strict=True):
            att, mlp = layer.self_attn, layer.mlp
            pairs = [
                (layer.input_layernorm.weight, "input_norm"),
                (att.q_proj.weight, "q"),
                (att.k_proj.weight, "k"),
                (att.v_proj.weight, "v"),
                (att.o_proj.weight, "o"),
                (layer.post_attention_layernorm.weight, "post_norm"),
                (mlp.gate_proj.weight, "gate"),
                (mlp.up_proj.weight, "up"),
                (mlp.down_proj.weight, "down"),
            ]
            for param, key in pairs:
                param.copy_(w[key])
    return pruned.eval()
