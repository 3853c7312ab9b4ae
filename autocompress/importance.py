"""Activation importance on calibration text (as Minitron does), and teacher outputs cached once.

Hidden channel importance: mean |activation| of every RMSNorm output (all layers and the final
norm), summed. FFN neuron importance: mean |act(gate(x)) * up(x)| per neuron, per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from autocompress.masking import Ranking


@torch.no_grad()
def rank_units(model: Any, tokens: torch.Tensor, batch_size: int = 4, progress: bool = True) -> Ranking:
    """Importance order of hidden channels and per-layer FFN neurons, most important first."""
    inner = model.model
    d = model.config.hidden_size
    hidden = torch.zeros(d, dtype=torch.float64)
    ffn = torch.zeros(len(inner.layers), model.config.intermediate_size, dtype=torch.float64)
    handles = []

    def on_norm(module: Any, args: Any, out: torch.Tensor) -> None:
        hidden.add_(out.abs().flatten(0, -2).mean(0).double())

    def on_ffn(idx: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            ffn[idx].add_(args[0].abs().flatten(0, -2).mean(0).double())

        return hook

    handles.append(inner.norm.register_forward_hook(on_norm))
    for idx, layer in enumerate(inner.layers):
        handles.append(layer.input_layernorm.register_forward_hook(on_norm))
        handles.append(layer.post_attention_layernorm.register_forward_hook(on_norm))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(on_ffn(idx)))
    try:
        for start in tqdm(range(0, len(tokens), batch_size), desc="importance", disable=not progress):
            model.model(input_ids=tokens[start : start + batch_size], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return Ranking(
        hidden=torch.argsort(hidden, descending=True, stable=True),
        ffn=torch.argsort(ffn, dim=1, descending=True, stable=True),
    )


@torch.no_grad()
def teacher_hidden(model: Any, tokens: torch.Tensor, batch_size: int = 4, progress: bool = True, desc: str = "teacher") -> torch.Tensor:
    """Final-norm hidden states of the unpruned model [n, s, d]; logits are lm_head(hidden)."""
    out = []
    for start in tqdm(range(0, len(tokens), batch_size), desc=desc, disable=not progress):
        out.append(model.model(input_ids=tokens[start : start + batch_size], use_cache=False).last_hidden_state)
    return torch.cat(out)
