"""The hooked model computes exactly what the pruned architecture computes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from autocompress.arch.importance import rank_units
from autocompress.arch.masking import MaskedModel, kv_merge_matrix
from autocompress.arch.space import Architecture, Block, SearchSpace
from autocompress.checkpoints.slicing import sliced_layers, to_llama


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_forward(model: Any, arch: Architecture, ranking: Any, ids: torch.Tensor) -> torch.Tensor:
    """A from-scratch heterogeneous (DeciLM-style) forward on the sliced weights: logits [b, s, V]."""
    glob, layers = sliced_layers(model, arch, ranking)
    eps, hd, nq = model.config.rms_norm_eps, arch.head_dim, arch.num_attention_heads
    x = glob["embed"][ids]  # [b, s, h]
    b, s, _ = x.shape
    cos, sin = model.model.rotary_emb(x, torch.arange(s)[None])
    for block, w in zip(arch.blocks, layers, strict=True):
        if block.kv_heads:
            y = rms(x, w["input_norm"], eps)
            q = (y @ w["q"].T).view(b, s, nq, hd).transpose(1, 2)
            k = (y @ w["k"].T).view(b, s, block.kv_heads, hd).transpose(1, 2)
            v = (y @ w["v"].T).view(b, s, block.kv_heads, hd).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            rep = nq // block.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + att.transpose(1, 2).reshape(b, s, nq * hd) @ w["o"].T
        if block.ffn:
            y = rms(x, w["post_norm"], eps)
            x = x + (F.silu(y @ w["gate"].T) * (y @ w["up"].T)) @ w["down"].T
    return rms(x, glob["norm"], eps) @ glob["embed"].T


def masked_logits(model: Any, space: SearchSpace, ranking: Any, arch: Architecture | None, ids: torch.Tensor) -> torch.Tensor:
    masked = MaskedModel(model, space, ranking)
    try:
        if arch is not None:
            masked.set_architecture(arch)
        with torch.no_grad():
            return model(ids).logits
    finally:
        masked.remove()


def test_kv_merge_matrix_averages_groups() -> None:
    m = kv_merge_matrix(4, 2)
    want = torch.tensor([[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5], [0, 0, 0.5, 0.5]], dtype=torch.float64)
    assert torch.equal(m, want)
    assert torch.equal(kv_merge_matrix(4, 4), torch.eye(4, dtype=torch.float64))


def test_kv_merge_matrix_is_exact_in_float64_for_three_heads_into_one() -> None:
    """3 -> 1 (SmolLM2's KV heads merged into one): every weight is float64(1/3), not fp32(1/3)."""
    m = kv_merge_matrix(3, 1)
    assert m.dtype == torch.float64
    assert torch.equal(m, torch.full((3, 3), 1 / 3, dtype=torch.float64))
    assert float(m[0, 0]) != float(torch.tensor(1 / 3, dtype=torch.float32))


def test_full_architecture_equals_unhooked_model(tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor) -> None:
    ranking = rank_units(tiny_model, tokens, progress=False)
    with torch.no_grad():
        ref = tiny_model(tokens).logits
    assert torch.equal(masked_logits(tiny_model, tiny_space, ranking, None, tokens), ref)
    assert torch.allclose(masked_logits(tiny_model, tiny_space, ranking, tiny_space.largest(), tokens), ref, atol=1e-5)


@pytest.mark.parametrize("h,kv,ffn,q", [(1, 1, 1, 1), (2, 2, 2, 1), (0, 1, 2, 1), (2, 2, 2, 0), (1, 1, 2, 0)])
def test_homogeneous_mask_equals_pruned_llama(
    tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor, h: int, kv: int, ffn: int, q: int
) -> None:
    ranking = rank_units(tiny_model, tokens, progress=False)
    n = tiny_space.num_layers
    arch = tiny_space.architecture(h, [kv] * n, [ffn] * n, q)
    pruned = to_llama(tiny_model, arch, ranking)
    assert sum(p.numel() for p in pruned.parameters()) == arch.num_params()
    with torch.no_grad():
        expected = pruned(tokens).logits
    assert torch.allclose(masked_logits(tiny_model, tiny_space, ranking, arch, tokens), expected, atol=1e-5)


def test_heterogeneous_mask_equals_reference_forward(tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor) -> None:
    ranking = rank_units(tiny_model, tokens, progress=False)
    arch = Architecture(**{**tiny_space.base.__dict__, "hidden_size": 48, "blocks": (Block(1, 64), Block(0, 96), Block(2, 0))})
    expected = reference_forward(tiny_model, arch, ranking, tokens)
    assert torch.allclose(masked_logits(tiny_model, tiny_space, ranking, arch, tokens), expected, atol=1e-5)
    halved = Architecture(**{**arch.__dict__, "num_attention_heads": 2})  # one query head of each KV group's two
    expected = reference_forward(tiny_model, halved, ranking, tokens)
    assert not torch.allclose(masked_logits(tiny_model, tiny_space, ranking, arch, tokens), expected, atol=1e-3)
    assert torch.allclose(masked_logits(tiny_model, tiny_space, ranking, halved, tokens), expected, atol=1e-5)


def test_skipping_dropped_layers_changes_nothing(tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor) -> None:
    """A layer without attention and FFN adds exactly 0: leaving it out of the forward gives the same logits, bit for bit;
    `clear` and `set` bring every layer back."""
    ranking = rank_units(tiny_model, tokens, progress=False)
    arch = Architecture(**{**tiny_space.base.__dict__, "hidden_size": 48, "blocks": (Block(1, 64), Block(0, 0), Block(2, 0))})
    layers = tiny_model.model.layers
    masked = MaskedModel(tiny_model, tiny_space, ranking)
    try:
        masked.set_architecture(arch)
        with torch.no_grad():
            full = tiny_model(tokens).logits
        masked.set_architecture(arch, skip_dropped=True)
        assert [id(m) for m in tiny_model.model.layers] == [id(layers[0]), id(layers[2])]
        with torch.no_grad():
            skipped = tiny_model(tokens).logits
        masked.clear()
        assert tiny_model.model.layers is layers
        masked.set_architecture(arch, skip_dropped=True)
        masked.set_architecture(tiny_space.largest())
        assert tiny_model.model.layers is layers
        masked.set_architecture(arch, skip_dropped=True)
    finally:
        masked.remove()
    assert tiny_model.model.layers is layers
    assert torch.equal(skipped, full)
    assert torch.allclose(full, reference_forward(tiny_model, arch, ranking, tokens), atol=1e-5)


def test_query_heads_are_ranked_within_their_kv_group(tiny_model: Any, tokens: torch.Tensor) -> None:
    """Every layer's order is a permutation in which positions g*r .. g*r+r-1 hold group g's heads, best first."""
    ranking = rank_units(tiny_model, tokens, progress=False)
    assert ranking.heads is not None and ranking.heads.shape == (3, 4)
    for layer in range(3):
        order = ranking.heads[layer].view(2, 2)
        assert torch.equal(torch.sort(order, dim=1).values, torch.tensor([[0, 1], [2, 3]]))
        kept = ranking.kept_heads(layer, 4, 2, 2)
        assert torch.equal(kept, torch.sort(order[:, 0]).values)


def test_soft_masks_carry_gradients(tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor) -> None:
    ranking = rank_units(tiny_model, tokens, progress=False)
    masked = MaskedModel(tiny_model, tiny_space, ranking)
    logits = [
        torch.zeros(len(tiny_space.hidden), requires_grad=True),
        torch.zeros(3, len(tiny_space.attention), requires_grad=True),
        torch.zeros(3, len(tiny_space.ffn), requires_grad=True),
        torch.zeros(len(tiny_space.heads), requires_grad=True),
    ]
    masked.set(*(torch.softmax(t, -1) for t in logits))
    tiny_model(tokens).logits.pow(2).mean().backward()
    masked.remove()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in logits)


def test_ranking_round_trips(tiny_model: Any, tokens: torch.Tensor, tmp_path: Any) -> None:
    from autocompress.arch.masking import Ranking

    ranking = rank_units(tiny_model, tokens, progress=False)
    ranking.save(tmp_path / "ranking.safetensors")
    again = Ranking.load(tmp_path / "ranking.safetensors")
    assert torch.equal(again.hidden, ranking.hidden) and torch.equal(again.ffn, ranking.ffn)
    assert ranking.heads is not None and again.heads is not None and torch.equal(again.heads, ranking.heads)
