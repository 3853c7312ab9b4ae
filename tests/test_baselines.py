"""Baselines that could win: homogeneous with every head kept, and greedy sublayer removal, both at the constraint."""

from __future__ import annotations

from typing import Any

import torch

from autocompress.arch.importance import sublayer_order
from autocompress.arch.space import Architecture, Block
from autocompress.baselines.naive import greedy_removal
from autocompress.search.rival import best_homogeneous, homogeneous_full_kv

from .test_minitron import smollm2_setup


def test_homogeneous_full_kv_takes_the_fewest_drops_per_ffn_width() -> None:
    space, cm, cons = smollm2_setup(0.8, 0.8)
    order = [29, 3, 17, *[i for i in range(1, 30) if i not in (29, 3, 17)]]
    found = homogeneous_full_kv(space, order, cm, cons)
    widths = [max(b.ffn for b in a.blocks) for a in found]
    assert found and widths == sorted(set(widths), reverse=True)  # one per FFN width, widest first
    for arch in found:
        kept = {b for b in arch.blocks if b != Block(0, 0)}
        assert len(kept) == 1 and next(iter(kept)).kv_heads == 3 and arch.hidden_size == 576 and arch.num_attention_heads == 9
        costs = cm.predict(arch)
        assert all(c.satisfied(costs[c.metric]) for c in cons)
        n_drop = sum(b == Block(0, 0) for b in arch.blocks)
        assert {i for i, b in enumerate(arch.blocks) if b == Block(0, 0)} == set(order[:n_drop])
        if n_drop:  # one block fewer dropped would miss a constraint
            ffn = next(iter(kept)).ffn
            blocks = tuple(Block(0, 0) if i in order[: n_drop - 1] else Block(3, ffn) for i in range(30))
            fewer = cm.predict(Architecture(**{**arch.__dict__, "blocks": blocks}))
            assert not all(c.satisfied(fewer[c.metric]) for c in cons)


def test_best_homogeneous_measures_only_the_screened_best() -> None:
    """With a screen, only the `keep` best by it are measured; the pick is the lowest measured, even where the screen
    ranked it second."""
    space, cm, cons = smollm2_setup(0.8, 0.8)
    archs = homogeneous_full_kv(space, list(range(29, -1, -1)), cm, cons)
    assert len(archs) > 3
    true_kl = {a: float(i) for i, a in enumerate(archs)}  # the widest is best ...
    screen = {a: -float(i) for i, a in enumerate(archs)}  # ... the screen favours the narrowest, then archs[0] fourth
    screen[archs[0]] = -len(archs) + 1.5  # archs[0] now second by the screen
    measured: list[Architecture] = []

    def kl(a: Architecture) -> float:
        measured.append(a)
        return true_kl[a]

    assert best_homogeneous(archs, kl, screen.__getitem__, keep=3) == (archs[0], 0.0)
    assert len(measured) == 3 and archs[0] in measured and archs[1] not in measured
    assert best_homogeneous(archs, true_kl.__getitem__) == (archs[0], 0.0)  # no screen: every one measured
    assert best_homogeneous([], kl, screen.__getitem__) is None


def test_greedy_removal_stops_at_the_first_feasible_architecture() -> None:
    space, cm, cons = smollm2_setup(0.8, 0.8)
    order = [(kind, i) for i in range(29, -1, -1) for kind in ("ffn", "attention")]
    arch = greedy_removal(space, order, cm, cons)
    assert arch is not None and space.allows(arch) and arch.hidden_size == 576
    costs = cm.predict(arch)
    assert all(c.satisfied(costs[c.metric]) for c in cons)
    removed = [(k, i) for k, i in order if (arch.blocks[i].ffn if k == "ffn" else arch.blocks[i].kv_heads) == 0]
    assert removed == order[: len(removed)]  # a prefix of the order: it stopped as soon as the constraints held
    space, cm, out_of_reach = smollm2_setup(0.01, 0.01)
    assert greedy_removal(space, order, cm, out_of_reach) is None


def test_sublayer_order_covers_every_sublayer(tiny_model: Any, tokens: torch.Tensor) -> None:
    order = sublayer_order(tiny_model, tokens)
    assert sorted(order) == sorted([(k, i) for k in ("attention", "ffn") for i in range(3)])
