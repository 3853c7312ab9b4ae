"""Activation importance on calibration text (as Minitron does), and teacher outputs cached once.

Hidden channel importance: mean |activation| of every RMSNorm output (all layers and the final
norm), summed. FFN neuron importance: mean |act(gate(x)) * up(x)| per neuron, per layer. Query-head
importance as ModelOpt's Minitron ranks heads: per channel of the output projection's input, the
L2 norm over sequences of the mean |activation| over tokens; per head the L2 norm over its channels;
heads ranked within their KV group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from autocompress.arch.masking import Ranking


def run_hooked(model: Any, tokens: torch.Tensor, handles: list[Any], batch_size: int, desc: str, progress: bool) -> None:
    """Run `model` over `tokens` [n, s] in batches so that the hooks behind `handles` collect; remove the hooks after."""
    try:
        for start in tqdm(range(0, len(tokens), batch_size), desc=desc, disable=not progress):
            model.model(input_ids=tokens[start : start + batch_size], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def block_influence_hook(blocks: torch.Tensor, idx: int) -> Any:
    """A forward hook (with kwargs) adding 1 - mean cosine(block input, block output) per pass into `blocks[idx]` (ModelOpt)."""

    def hook(module: Any, args: Any, kwargs: Any, out: Any) -> None:
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        y = out[0] if isinstance(out, tuple) else out
        blocks[idx] += float(1 - F.cosine_similarity(x.float(), y.float(), dim=-1).mean())

    return hook


def sequence_l2_part(x: torch.Tensor) -> torch.Tensor:
    """[b, s, c] -> [c]: sum over sequences of (mean over tokens of |x|)^2; its square root is ModelOpt's L2 aggregate."""
    return x.float().abs().mean(dim=1).pow(2).sum(dim=0).double()


def head_order(o_proj_sq: torch.Tensor, num_heads: int, groups: int) -> torch.Tensor:
    """[L, nq*hd] accumulated `sequence_l2_part` of o_proj inputs -> [L, nq] head ids, most important first within each KV group.

    Position g*r + j holds group g's j-th most important head (r = nq / groups), as ModelOpt's
    group-aware ranking; keeping m heads per group keeps positions g*r .. g*r + m - 1.
    """
    layers = o_proj_sq.shape[0]
    per_head = o_proj_sq.sqrt().view(layers, num_heads, -1).norm(dim=2)  # [L, nq]
    r = num_heads // groups
    within = per_head.view(layers, groups, r).argsort(dim=2, descending=True, stable=True)  # [L, G, r]
    return (within + torch.arange(0, num_heads, r)[None, :, None]).flatten(1)


@torch.no_grad()
def rank_units(model: Any, tokens: torch.Tensor, batch_size: int = 4, progress: bool = True) -> Ranking:
    """Importance order of hidden channels and per-layer FFN neurons, most important first."""
    inner = model.model
    d = model.config.hidden_size
    hidden = torch.zeros(d, dtype=torch.float64)
    ffn = torch.zeros(len(inner.layers), model.config.intermediate_size, dtype=torch.float64)
    nq, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    o_sq = torch.zeros(len(inner.layers), inner.layers[0].self_attn.o_proj.in_features, dtype=torch.float64)
    handles = []

    def on_norm(module: Any, args: Any, out: torch.Tensor) -> None:
        hidden.add_(out.abs().flatten(0, -2).mean(0).double())

    def on_ffn(idx: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            ffn[idx].add_(args[0].abs().flatten(0, -2).mean(0).double())

        return hook

    def on_o_proj(idx: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            o_sq[idx].add_(sequence_l2_part(args[0]))

        return hook

    handles.append(inner.norm.register_forward_hook(on_norm))
    for idx, layer in enumerate(inner.layers):
        handles.append(layer.input_layernorm.register_forward_hook(on_norm))
        handles.append(layer.post_attention_layernorm.register_forward_hook(on_norm))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(on_ffn(idx)))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(on_o_proj(idx)))
    run_hooked(model, tokens, handles, batch_size, "importance", progress)
    return Ranking(
        hidden=torch.argsort(hidden, descending=True, stable=True),
        ffn=torch.argsort(ffn, dim=1, descending=True, stable=True),
        heads=head_order(o_sq, nq, kv),
    )


@torch.no_grad()
def teacher_hidden(model: Any, tokens: torch.Tensor, batch_size: int = 4, progress: bool = True, desc: str = "teacher") -> torch.Tensor:
    """Final-norm hidden states of the unpruned model [n, s, d]; logits are lm_head(hidden)."""
    out = []
    for start in tqdm(range(0, len(tokens), batch_size), desc=desc, disable=not progress):
        out.append(model.model(input_ids=tokens[start : start + batch_size], use_cache=False).last_hidden_state)
    return torch.cat(out)


@torch.no_grad()
def sublayer_order(model: Any, tokens: torch.Tensor, batch_size: int = 4) -> list[tuple[str, int]]:
    """Attention and FFN sublayers from least to most important: 1 - mean cos(residual before, residual after) on `tokens`."""
    inner = model.model
    n = len(inner.layers)
    scores = torch.zeros(2, n, dtype=torch.float64)  # [attention | ffn, layer]
    mid: dict[int, torch.Tensor] = {}

    def on_mid(idx: int) -> Any:  # post_attention_layernorm's input: the residual after attention
        def hook(module: Any, args: Any) -> None:
            mid[idx] = args[0]

        return hook

    def on_layer(idx: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any, out: Any) -> None:
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            y = out[0] if isinstance(out, tuple) else out
            cos = torch.nn.functional.cosine_similarity
            scores[0, idx] += float(1 - cos(x.float(), mid[idx].float(), dim=-1).mean())
            scores[1, idx] += float(1 - cos(mid[idx].float(), y.float(), dim=-1).mean())

        return hook

    handles = []
    for idx, layer in enumerate(inner.layers):
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(on_mid(idx)))
        handles.append(layer.register_forward_hook(on_layer(idx), with_kwargs=True))
    try:
        for start in range(0, len(tokens), batch_size):
            inner(input_ids=tokens[start : start + batch_size], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    flat = [(float(scores[k, i]), ("attention", "ffn")[k], i) for k in range(2) for i in range(n)]
    return [(kind, i) for _, kind, i in sorted(flat)]


@dataclass
class Importance:
    hidden: torch.Tensor  # [d]
    ffn: torch.Tensor  # [L, i]
    blocks: torch.Tensor  # [L], higher = more important
    heads: torch.Tensor  # [L, nq] head ids, most important first within each KV group

    def ranking(self) -> Ranking:
        return Ranking(
            hidden=torch.argsort(self.hidden, descending=True, stable=True),
            ffn=torch.argsort(self.ffn, dim=1, descending=True, stable=True),
            heads=self.heads,
        )

    def drop_order(self) -> list[int]:
        """Layers from least to most important, layer 0 excluded (it always keeps its attention)."""
        return [int(i) for i in torch.argsort(self.blocks, stable=True) if int(i) != 0]


@torch.no_grad()
def importance(model: Any, tokens: torch.Tensor, batch_size: int = 4, progress: bool = True) -> Importance:
    """Minitron activation importance of hidden channels, query heads, FFN neurons and blocks on `tokens` [n, s]."""
    layers = model.model.layers
    n_layers, d, inter = len(layers), model.config.hidden_size, model.config.intermediate_size
    norm_sq = torch.zeros(2 * n_layers, d, dtype=torch.float64)  # per norm: sum over sequences of (mean_s |x|)^2
    ffn_sq = torch.zeros(n_layers, inter, dtype=torch.float64)
    o_sq = torch.zeros(n_layers, layers[0].self_attn.o_proj.in_features, dtype=torch.float64)
    blocks = torch.zeros(n_layers, dtype=torch.float64)

    def on_norm(slot: int) -> Any:
        def hook(module: Any, args: Any, out: torch.Tensor) -> None:  # returns None: the output stays as it is
            norm_sq[slot].add_(sequence_l2_part(out))

        return hook

    def on_input(acc: torch.Tensor, idx: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            acc[idx].add_(sequence_l2_part(args[0]))

        return hook

    handles = []
    for idx, layer in enumerate(layers):
        handles.append(layer.input_layernorm.register_forward_hook(on_norm(2 * idx)))
        handles.append(layer.post_attention_layernorm.register_forward_hook(on_norm(2 * idx + 1)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(on_input(ffn_sq, idx)))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(on_input(o_sq, idx)))
        handles.append(layer.register_forward_hook(block_influence_hook(blocks, idx), with_kwargs=True))
    run_hooked(model, tokens, handles, batch_size, "minitron importance", progress)
    heads = head_order(o_sq, model.config.num_attention_heads, model.config.num_key_value_heads)
    return Importance(hidden=norm_sq.sqrt().sum(0), ffn=ffn_sq.sqrt(), blocks=blocks, heads=heads)
