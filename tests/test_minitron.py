"""The Minitron baseline: importance without side effects, homogeneous feasible candidates only, a verified checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from autocompress.arch.importance import importance, teacher_hidden
from autocompress.arch.space import Architecture, Block, SearchSpace
from autocompress.baselines.minitron import (
    MinitronSpec,
    enumerate_candidates,
    feasible_candidates,
    grid,
    limit_levels,
    modelopt_choices,
    search,
    to_score,
    write_checkpoint,
)
from autocompress.config.metrics import Constraint
from autocompress.config.schema import Hardware, SpaceSpec, Workload
from autocompress.cost import AnalyticCostModel
from autocompress.errors import ConfigError, InfeasibleError
from autocompress.model.base import ByteTokenizer

from .test_arch import SMOLLM2

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models gain nothing from threads


def smollm2_setup(memory: float, tpot: float) -> tuple[SearchSpace, AnalyticCostModel, tuple[Constraint, ...]]:
    """SmolLM2's space and an RTX 5070-like long-context cost model; bounds as shares of the base model's costs."""
    space = SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec())
    hw = Hardware(name="gpu", peak_tflops=123.5, mem_bandwidth_gbs=672, memory_gib=12)
    wl = Workload(name="w", prompt_len=16000, output_len=512, concurrency=4, context_len=32768)
    cm = AnalyticCostModel(space, hw, wl)
    base = cm.predict(space.largest())
    return space, cm, (Constraint("memory_gib", memory * base["memory_gib"]), Constraint("tpot_ms", tpot * base["tpot_ms"]))


def test_modelopt_choices_keep_the_top_share_of_each_axis() -> None:
    """`sorted(choices)[int((1 - p) * len(choices)):]` over multiples of the divisor, as ModelOpt filters its grid."""
    assert modelopt_choices(576, 64, 0.4) == [384, 448, 512, 576]
    assert modelopt_choices(9, 3, 0.4) == [6, 9]  # query heads: multiples of the 3 KV groups
    assert modelopt_choices(1536, 128, 0.4) == [1024, 1152, 1280, 1408, 1536]
    assert modelopt_choices(30, 1, 0.2) == [25, 26, 27, 28, 29, 30]
    assert modelopt_choices(30, 2, 0.2) == [26, 28, 30]  # layers (ModelOpt's divisor 2): 0, 2 or 4 of 30 dropped
    assert modelopt_choices(30, 1, 0.0) == [30]


def test_candidates_keep_every_kv_group_and_meet_the_constraints() -> None:
    space, cm, cons = smollm2_setup(0.9, 0.9)
    drop_order = [29, 3, 17, *[i for i in range(1, 30) if i not in (29, 3, 17)]]
    found = enumerate_candidates(space, drop_order, cm, cons, MinitronSpec())
    assert found
    for cand in found:
        kept = [b for i, b in enumerate(cand.arch.blocks) if i not in cand.dropped]
        assert len(set(kept)) == 1 and kept[0] == Block(3, cand.ffn) and cand.kv_heads == 3  # KV groups are never pruned
        assert all(cand.arch.blocks[i] == Block(0, 0) for i in cand.dropped)
        assert 0 not in cand.dropped and len(cand.dropped) in (0, 2, 4)
        assert cand.dropped == tuple(sorted(drop_order[: len(cand.dropped)]))  # the least important blocks go first
        assert cand.arch.num_attention_heads == cand.heads and cand.heads in (6, 9)
        assert cand.hidden >= 384 and cand.ffn >= 1024
        assert space.allows(cand.arch) and cand.params == cand.arch.num_params()
        costs = cm.predict(cand.arch)
        assert all(c.satisfied(costs[c.metric]) for c in cons)
    assert [c.params for c in found] == sorted((c.params for c in found), reverse=True)
    # every grid shape left out misses a constraint: the whole grid without depth pruning
    listed = {(c.hidden, c.heads, c.ffn) for c in found if not c.dropped}
    for h in (384, 448, 512, 576):
        for q in (6, 9):
            for f in (1024, 1152, 1280, 1408, 1536):
                arch = Architecture(**{**space.base.__dict__, "hidden_size": h, "num_attention_heads": q, "blocks": (Block(3, f),) * 30})
                costs = cm.predict(arch)
                assert ((h, q, f) in listed) == all(c.satisfied(costs[c.metric]) for c in cons)


def test_limit_levels_raise_every_pair_by_the_same_total() -> None:
    levels = limit_levels(MinitronSpec())
    assert levels[:4] == [
        [(0.4, 0.2)],
        [(0.4, 0.3), (0.5, 0.2)],
        [(0.4, 0.4), (0.5, 0.3), (0.6, 0.2)],
        [(0.4, 0.5), (0.5, 0.4), (0.6, 0.3), (0.7, 0.2)],
    ]
    assert levels[-1] == [(0.9, 0.9)] and len(levels) == 13  # 5 width steps + 7 depth steps
    for n, level in enumerate(levels):
        assert all(round((w - 0.4) + (d - 0.2), 6) == round(n * 0.1, 6) and w <= 0.9 and d <= 0.9 for w, d in level)
    assert limit_levels(MinitronSpec(widen=False)) == [[(0.4, 0.2)]]


def test_limits_are_widened_a_level_at_a_time_and_recorded() -> None:
    space, cm, cons = smollm2_setup(0.7, 0.7)
    order = list(range(1, 30))
    spec = MinitronSpec()
    assert enumerate_candidates(space, order, cm, cons, spec) == []  # nothing within ModelOpt's defaults
    admitted, record = feasible_candidates(space, order, cm, cons, spec)
    assert admitted and record["widened"]
    levels = limit_levels(spec)
    pairs = [(a.width, a.depth) for a in admitted]
    at = next(i for i, level in enumerate(levels) if pairs[0] in level)
    # every admitting pair of the level is kept, each with exactly what enumerate_candidates finds there
    for width, depth in levels[at]:
        found = enumerate_candidates(space, order, cm, cons, spec, width, depth)
        assert ((width, depth) in pairs) == bool(found)
        if found:
            assert next(a.candidates for a in admitted if (a.width, a.depth) == (width, depth)) == found
    assert max(len(a.candidates) for a in admitted) >= spec.top_k  # widened until one pair gives the score ModelOpt's top 10 ...
    for level in levels[:at]:  # ... and no further
        assert all(len(enumerate_candidates(space, order, cm, cons, spec, w, d)) < spec.top_k for w, d in level)
    assert [(t["max_width_pruning"], t["max_depth_pruning"]) for t in record["tried"]] == [p for level in levels[: at + 1] for p in level]
    first, _ = feasible_candidates(space, order, cm, cons, MinitronSpec(top_k=1))  # top_k=1: the first level that admits any
    at1 = next(i for i, level in enumerate(levels) if (first[0].width, first[0].depth) in level)
    assert at1 <= at and all(enumerate_candidates(space, order, cm, cons, spec, w, d) == [] for level in levels[:at1] for w, d in level)
    with pytest.raises(InfeasibleError, match="widen"):
        feasible_candidates(space, order, cm, cons, MinitronSpec(widen=False))


def test_the_score_sees_each_pairs_top_k_once() -> None:
    space, cm, cons = smollm2_setup(0.7, 0.7)
    admitted, _ = feasible_candidates(space, list(range(1, 30)), cm, cons, MinitronSpec())
    scored = to_score(admitted, 10)
    keys = [c.arch.to_json() for c, _ in scored]
    assert len(keys) == len(set(keys))
    for a in admitted:  # every pair's top 10 is scored, and says so
        for c in a.candidates[:10]:
            assert f"{a.width:g}/{a.depth:g}" in scored[keys.index(c.arch.to_json())][1]
    assert len(scored) == len({c.arch.to_json() for a in admitted for c in a.candidates[:10]})
    assert [c.params for c, _ in scored] == sorted((c.params for c, _ in scored), reverse=True)


def test_default_limits_keep_a_short_list_as_modelopt_would() -> None:
    """Within ModelOpt's own limits nothing is widened, however few candidates they admit."""
    space, cm, cons = smollm2_setup(0.9, 0.9)
    order = list(range(1, 30))
    within = enumerate_candidates(space, order, cm, cons, MinitronSpec())
    assert within
    admitted, record = feasible_candidates(space, order, cm, cons, MinitronSpec(top_k=len(within) + 5))
    assert len(admitted) == 1 and admitted[0].candidates == within and not record["widened"]
    assert record["tried"] == [{"max_width_pruning": 0.4, "max_depth_pruning": 0.2, "feasible": len(within)}]


def test_kv_pooling_is_an_ablation_under_its_own_name() -> None:
    space, cm, cons = smollm2_setup(0.9, 0.9)
    spec = MinitronSpec(prune_kv_groups=True)
    found = enumerate_candidates(space, list(range(1, 30)), cm, cons, spec)
    assert {c.kv_heads for c in found} == {1, 3}
    assert "ablation" in spec.label and "Minitron" not in spec.label and "Minitron" in MinitronSpec().label


def test_no_candidate_when_constraints_are_out_of_reach() -> None:
    space, cm, cons = smollm2_setup(0.05, 0.05)  # the widening reaches 0.9 / 0.9 before it refuses: the whole grid is priced once
    with pytest.raises(InfeasibleError, match="no homogeneous Minitron candidate"):
        feasible_candidates(space, list(range(1, 30)), cm, cons, MinitronSpec())


def test_importance_hooks_leave_the_model_unchanged(tiny_model: Any, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        before = tiny_model(tokens).logits
    imp = importance(tiny_model, tokens, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(tokens).logits, before)
    assert imp.hidden.shape == (64,) and imp.ffn.shape == (3, 96) and imp.blocks.shape == (3,) and imp.heads.shape == (3, 4)
    assert bool((imp.blocks > 0).all()) and imp.drop_order() and 0 not in imp.drop_order()
    ranking = imp.ranking()
    assert sorted(ranking.hidden.tolist()) == list(range(64)) and int(ranking.hidden[0]) == int(imp.hidden.argmax())


def test_a_budget_scores_the_most_parameters_over_every_pair() -> None:
    """compare.minitron.budget N (the headline's equal budget): the N candidates with the most parameters among every
    pair's admitted ones, each once, however many each pair's top_k would have given."""
    space, cm, cons = smollm2_setup(0.7, 0.7)
    spec = MinitronSpec(widen_all=True, layers_divisor=1, budget=8)
    admitted, _ = feasible_candidates(space, list(range(1, 30)), cm, cons, spec)
    everything = sorted({c.arch.to_json(): c.params for a in admitted for c in a.candidates}.values(), reverse=True)
    assert len(everything) > 8 and len(to_score(admitted, spec.top_k)) > 8  # the budget cuts something here
    scored = to_score(admitted, spec.budget)[: spec.budget]
    assert [c.params for c, _ in scored] == everything[:8]
    with pytest.raises(ConfigError, match="budget must be > 0"):
        MinitronSpec(budget=0)


def test_search_picks_the_best_scored_of_the_top_k_and_exports_it(tiny_model: Any, tiny_space: SearchSpace, tmp_path: Path) -> None:
    cm = AnalyticCostModel(
        tiny_space,
        Hardware(name="cpu", peak_tflops=0.1, mem_bandwidth_gbs=20, memory_gib=16, step_overhead_ms=0, block_overhead_us=0),
        Workload(name="w", prompt_len=64, output_len=16, concurrency=2, context_len=128),
    )
    cons = (Constraint("ttft_ms", 0.9 * cm.predict(tiny_space.largest())["ttft_ms"]),)
    calib = torch.randint(0, 256, (6, 24), generator=torch.Generator().manual_seed(1))
    score = calib[:2]
    res = search(
        tiny_model, tiny_space, cm, cons, calib, score, teacher_hidden(tiny_model, score, progress=False), MinitronSpec(top_k=4), False
    )
    assert len(res.scored) == min(4, res.feasible) and int(res.scored["chosen"].sum()) == 1
    chosen = res.scored[res.scored["chosen"]].iloc[0]
    assert chosen["kl"] == res.scored["kl"].min() and chosen["architecture"] == res.best.arch.to_json()
    assert list(res.scored["params"]) == sorted(res.scored["params"], reverse=True)
    assert set(res.scored["kv_heads"]) == {2} and set(res.limits) == {"max_width_pruning", "max_depth_pruning", "widened", "tried"}
    fmt = write_checkpoint(tiny_model, ByteTokenizer(), tiny_space, res.ranking, res.best.arch, tmp_path / "mt", calib[:2], "# card")
    assert fmt in ("llama", "decilm") and (tmp_path / "mt" / "config.json").exists()  # verify_export raised otherwise
    assert "Verified" in (tmp_path / "mt" / "README.md").read_text()
    teacher = teacher_hidden(tiny_model, score, progress=False)
    budgeted = search(tiny_model, tiny_space, cm, cons, calib, score, teacher, MinitronSpec(top_k=4, budget=2), False)
    assert list(budgeted.scored["architecture"]) == list(res.scored["architecture"][:2])  # the 2 with the most parameters


def test_tuned_knobs_any_depth_and_every_level() -> None:
    """layers_divisor 1 admits odd layer counts; widen_all scores every pair of every level that admits any."""
    space, cm, cons = smollm2_setup(0.7, 0.7)
    drop_order = list(range(29, 0, -1))
    g2 = grid(space, MinitronSpec(), 0.4, 0.5, len(drop_order))
    g1 = grid(space, MinitronSpec(layers_divisor=1), 0.4, 0.5, len(drop_order))
    assert all(d % 2 == 0 for d in g2.drops) and any(d % 2 for d in g1.drops) and set(g2.drops) < set(g1.drops)
    first, _ = feasible_candidates(space, drop_order, cm, cons, MinitronSpec())
    every, record = feasible_candidates(space, drop_order, cm, cons, MinitronSpec(widen_all=True))
    pairs = {(a.width, a.depth) for a in every}
    assert {(a.width, a.depth) for a in first} < pairs  # the first admitting level's pairs, and more
    assert pairs == {(t["max_width_pruning"], t["max_depth_pruning"]) for t in record["tried"] if t["feasible"]}
    assert max(w + d for w, d in pairs) == pytest.approx(1.8)  # up to 0.9 / 0.9
    with pytest.raises(ConfigError, match="layers_divisor"):
        MinitronSpec(layers_divisor=0)
