"""Architecture masks attached to an unmodified Hugging Face Llama model with forward hooks.

Given (relaxed) one-hot choices per decision, the hooks make the model compute exactly what the
pruned architecture computes:
- hidden width: embedding output and every residual write (o_proj, down_proj) keep the top-ranked
  channels; RMSNorm statistics are taken over the kept channels only (as in the pruned model);
- query heads: whole heads are removed within every KV group (the top-ranked ones of each group
  kept, as Minitron prunes them) by zeroing their slice of the output projection's input;
- attention: K and V heads are mean-pooled within groups of consecutive heads (query head i keeps
  using merged head i // (n_q / kv)); a no-op layer's attention output is zeroed;
- FFN: the top-ranked intermediate neurons of each layer are kept (none for a no-op FFN).
With soft choices the masks are the probability-weighted mixtures of the options' masks.
With no choices set, the hooks do nothing and the model is the unpruned teacher.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from autocompress.arch.space import Architecture, SearchSpace


@dataclass
class Ranking:
    """Importance order of prunable units, most important first."""

    hidden: torch.Tensor  # [d] channel ids
    ffn: torch.Tensor  # [L, i] neuron ids per layer
    heads: torch.Tensor | None = None  # [L, nq] query-head ids per layer, KV group by group (None = index order)

    def same_as(self, other: Ranking) -> bool:
        """The same order of every unit (a resumed sweep's fresh ranking against the one its trials used)."""
        heads = (self.heads is None and other.heads is None) or (
            self.heads is not None and other.heads is not None and torch.equal(self.heads, other.heads)
        )
        return heads and torch.equal(self.hidden, other.hidden) and torch.equal(self.ffn, other.ffn)

    def head_order(self, num_layers: int, num_heads: int) -> torch.Tensor:
        """[L, nq]: per layer, group g's query heads (ids g*r .. g*r+r-1) most important first at positions g*r .."""
        if self.heads is not None:
            return self.heads
        return torch.arange(num_heads).expand(num_layers, num_heads).clone()

    def kept_heads(self, layer: int, num_heads: int, groups: int, kept: int) -> torch.Tensor:
        """Sorted ids of the `kept` query heads of `layer`: the first kept / groups of every KV group's ranking."""
        order = self.head_order(layer + 1, num_heads)[layer].view(groups, num_heads // groups)
        return torch.sort(order[:, : kept // groups].flatten()).values

    def save(self, path: Path) -> None:
        """Write to `path` (safetensors) atomically."""
        from safetensors.torch import save_file

        from autocompress.io import atomic_write

        tensors = {"hidden": self.hidden.contiguous(), "ffn": self.ffn.contiguous()}
        if self.heads is not None:
            tensors["heads"] = self.heads.contiguous()
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))

    @staticmethod
    def load(path: Path) -> Ranking:
        from safetensors.torch import load_file

        data = load_file(str(path))
        return Ranking(hidden=data["hidden"], ffn=data["ffn"], heads=data.get("heads"))


@dataclass
class _Masks:
    hidden: torch.Tensor  # [d]
    width: torch.Tensor  # scalar: kept hidden channels (for RMSNorm statistics)
    heads: torch.Tensor | None  # [L, nq*hd] query-head mask on the output projection's input (None = all heads)
    kv_mix: torch.Tensor  # [L, kv, kv] float64: merged head k = sum_j kv_mix[l, k, j] * head j
    attn_gate: torch.Tensor  # [L]
    ffn: torch.Tensor  # [L, i]


def kv_merge_matrix(base_kv: int, kept: int) -> torch.Tensor:
    """[base_kv, base_kv] float64 matrix replacing every head by the mean of its group of base_kv // kept heads.

    float64, so that the export's float64 check compares against 1/3, not fp32(1/3); it is cast to
    the activations' dtype where it is applied.
    """
    if kept == 0:
        return torch.eye(base_kv, dtype=torch.float64)
    group = base_kv // kept
    ids = torch.arange(base_kv) // group
    return (ids[:, None] == ids[None, :]).to(torch.float64) / group


class MaskedModel:
    """Hooks a LlamaForCausalLM so that `set(...)` selects the architecture its forward computes."""

    def __init__(self, model: Any, space: SearchSpace, ranking: Ranking) -> None:
        self.model, self.space = model, space
        base = space.base
        d = base.hidden_size
        pos = torch.empty(d, dtype=torch.long)
        pos[ranking.hidden] = torch.arange(d)  # rank position of every channel
        self._p_hidden = (pos[None, :] < torch.tensor(space.hidden)[:, None]).float()  # [H, d]
        i = base.blocks[0].ffn
        ffn_pos = torch.empty_like(ranking.ffn)
        ffn_pos.scatter_(1, ranking.ffn, torch.arange(i).expand_as(ranking.ffn))
        self._p_ffn = (ffn_pos[:, None, :] < torch.tensor(space.ffn)[None, :, None]).float()  # [L, F, i]
        kv, nq, hd = base.blocks[0].kv_heads, base.num_attention_heads, base.head_dim
        self._kv_mats = torch.stack([kv_merge_matrix(kv, k) for k in space.attention])  # [A, kv, kv] float64
        head_masks = torch.zeros(base.num_layers, len(space.heads), nq)  # [L, Q, nq]
        for layer in range(base.num_layers):
            for q, kept in enumerate(space.heads):
                head_masks[layer, q, ranking.kept_heads(layer, nq, kv, kept)] = 1.0
        self._p_heads = head_masks.repeat_interleave(hd, dim=2)  # [L, Q, nq*hd]
        self._gate = torch.tensor([float(k > 0) for k in space.attention])  # [A]
        self._widths = torch.tensor(space.hidden, dtype=torch.float32)  # [H]
        self._masks: _Masks | None = None
        self._layers: Any = None  # the model's own layer list while `set_architecture(skip_dropped=True)` left some out
        self._handles: list[Any] = []
        self._attach()

    # ------------------------------------------------------------------ selecting an architecture

    def set(self, hidden: torch.Tensor, attention: torch.Tensor, ffn: torch.Tensor, heads: torch.Tensor | None = None) -> None:
        """Choices as (relaxed) one-hot weights: hidden [H], attention [L, A], ffn [L, F], query heads [Q] (None = all)."""
        self.clear()  # every layer computes again
        self._masks = _Masks(
            hidden=hidden @ self._p_hidden,
            width=hidden @ self._widths,
            heads=None if heads is None else torch.einsum("q,lqc->lc", heads, self._p_heads),
            kv_mix=torch.einsum("la,akj->lkj", attention.to(torch.float64), self._kv_mats),
            attn_gate=attention @ self._gate,
            ffn=torch.einsum("lf,lfi->li", ffn, self._p_ffn),
        )

    def set_architecture(self, arch: Architecture, skip_dropped: bool = False) -> None:
        """`arch` as hard masks. `skip_dropped`: until `clear`, the forward also leaves out the layers whose attention
        and FFN are both no-ops (their masked output adds exactly 0 to the residual stream), which saves their compute."""
        h, att, ffn, q = self.space.indices(arch)
        onehot = torch.nn.functional.one_hot
        self.set(
            onehot(torch.tensor(h), len(self.space.hidden)).float(),
            onehot(torch.tensor(att), len(self.space.attention)).float(),
            onehot(torch.tensor(ffn), len(self.space.ffn)).float(),
            onehot(torch.tensor(q), len(self.space.heads)).float(),
        )
        if skip_dropped:  # exact as long as the no-op masks are: Llama's projections here carry no bias
            self._layers = self.model.model.layers
            kept = [layer for layer, b in zip(self._layers, arch.blocks, strict=True) if b.kv_heads or b.ffn]
            self.model.model.layers = torch.nn.ModuleList(kept)

    def clear(self) -> None:
        """Back to the unpruned teacher."""
        self._masks = None
        if self._layers is not None:
            assert len(self.model.model.layers) <= len(self._layers), "another MaskedModel changed the layers in between"
            self.model.model.layers = self._layers
            self._layers = None

    def remove(self) -> None:
        self.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ hooks

    def _attach(self) -> None:
        inner = self.model.model
        self._hook(inner.embed_tokens, self._mask_hidden)
        self._hook(inner.norm, self._norm)
        for idx, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self._hook(layer.input_layernorm, self._norm)
            self._hook(layer.post_attention_layernorm, self._norm)
            self._hook(attn.k_proj, partial(self._merge_kv, idx, attn.head_dim))
            self._hook(attn.v_proj, partial(self._merge_kv, idx, attn.head_dim))
            self._hook(attn.o_proj, partial(self._gate_attention, idx))
            self._handles.append(attn.o_proj.register_forward_pre_hook(partial(self._mask_heads, idx)))
            self._hook(mlp.down_proj, self._mask_hidden)
            self._handles.append(mlp.down_proj.register_forward_pre_hook(partial(self._mask_ffn, idx)))

    def _hook(self, module: Any, fn: Any) -> None:
        self._handles.append(module.register_forward_hook(fn))

    def _mask_hidden(self, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        return None if self._masks is None else out * self._masks.hidden

    def _norm(self, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        """RMSNorm over the kept channels: x * rsqrt(sum(x^2) / width + eps) * weight, pruned channels 0."""
        m = self._masks
        if m is None:
            return None
        x = args[0]  # [b, s, d]; pruned channels are already 0 in the residual stream
        x = x.to(torch.promote_types(x.dtype, torch.float32))  # at least fp32, as LlamaRMSNorm; float64 stays
        var = x.pow(2).sum(-1, keepdim=True) / m.width
        return (module.weight * (x * torch.rsqrt(var + module.variance_epsilon)) * m.hidden).to(out.dtype)

    def _merge_kv(self, idx: int, head_dim: int, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if self._masks is None:
            return None
        shape = out.shape
        heads = out.view(*shape[:-1], -1, head_dim)  # [b, s, kv, hd]
        return torch.einsum("bsjd,kj->bskd", heads, self._masks.kv_mix[idx].to(heads.dtype)).reshape(shape)

    def _gate_attention(self, idx: int, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        m = self._masks
        return None if m is None else out * (m.attn_gate[idx] * m.hidden)

    def _mask_heads(self, idx: int, module: Any, args: Any) -> tuple[torch.Tensor] | None:
        m = self._masks
        return None if m is None or m.heads is None else (args[0] * m.heads[idx].to(args[0].dtype),)

    def _mask_ffn(self, idx: int, module: Any, args: Any) -> tuple[torch.Tensor] | None:
        return None if self._masks is None else (args[0] * self._masks.ffn[idx],)
