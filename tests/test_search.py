"""One search run on the tiny model, without Ray."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from autocompress.arch.importance import importance as block_importance
from autocompress.arch.masking import MaskedModel
from autocompress.config.metrics import Constraint
from autocompress.config.schema import LagrangianSettings
from autocompress.search.differentiable import evaluate, run_search, violation
from autocompress.search.prepare import prepare
from autocompress.search.rival import homogeneous_full_kv

from .conftest import TINY_CPU, compose_spec


def test_violation_sign_and_margin() -> None:
    upper, lower = Constraint("tpot_ms", 10.0), Constraint("throughput_tok_s", 100.0)
    assert float(violation(upper, torch.tensor(12.0))) == pytest.approx(0.2)
    assert float(violation(upper, torch.tensor(8.0))) < 0
    assert float(violation(upper, torch.tensor(9.5), margin=0.1)) > 0  # aims 10% inside the bound
    assert float(violation(lower, torch.tensor(80.0))) == pytest.approx(0.2)
    assert float(violation(lower, torch.tensor(120.0))) < 0


@pytest.fixture(scope="module")
def prepared():  # type: ignore[no-untyped-def]
    spec = compose_spec("+scenario=cpu_interactive", *TINY_CPU)
    return spec, prepare(spec, progress=False)


@pytest.mark.parametrize(
    "settings", [LagrangianSettings(), LagrangianSettings(dual_lr=0.0, lambda_init=5.0, margin=0.1, seed=3)], ids=["dual", "fixed"]
)
def test_search_ends_feasible(prepared, settings: LagrangianSettings) -> None:  # type: ignore[no-untyped-def]
    spec, p = prepared
    steps: list[dict[str, float]] = []
    result = run_search(p.base.model, p.inputs, p.cost_model, spec.search, settings, on_step=steps.append)
    assert len(steps) == spec.search.steps
    assert result.all_feasible
    costs = p.cost_model.predict(result.architecture)
    assert all(c.satisfied(costs[c.metric]) for c in p.inputs.constraints)
    assert result.kl >= 0 and result.perplexity > 1
    assert result.kl_select >= 0 and result.perplexity_select > 1
    assert result.perplexity_select != result.perplexity  # the selection and report splits are different text
    if settings.dual_lr == 0:
        assert all(s[f"lambda_{c.metric}"] == settings.lambda_init for s in steps for c in p.inputs.constraints)
    else:
        assert all(s[f"lambda_{c.metric}"] >= 0 for s in steps for c in p.inputs.constraints)


def test_homogeneous_rival_competes_with_the_search(prepared) -> None:  # type: ignore[no-untyped-def]
    """The prepared rival is full-width and feasible, a homogeneous shape or one filled from it (upgrades only);
    a search keeps whichever of the two has the lower selection KL."""
    spec, p = prepared
    rival = p.inputs.homogeneous
    assert rival is not None and p.space.allows(rival)
    assert rival.hidden_size == p.space.base.hidden_size and rival.num_attention_heads == p.space.base.num_attention_heads
    drop_order = block_importance(p.base.model, p.inputs.calib[: spec.search.importance_sequences], progress=False).drop_order()
    shapes = homogeneous_full_kv(p.space, drop_order, p.cost_model, p.inputs.constraints)
    assert any(all(r.kv_heads >= h.kv_heads and r.ffn >= h.ffn for r, h in zip(rival.blocks, s.blocks, strict=True)) for s in shapes)
    costs = p.cost_model.predict(rival)
    assert all(c.satisfied(costs[c.metric]) for c in p.inputs.constraints)
    masked = MaskedModel(p.base.model, p.space, p.inputs.ranking)
    try:  # what trials reuse for the prepared rival is its measurement on the selection split
        assert p.inputs.homogeneous_select == evaluate(p.base.model, masked, rival, p.inputs.select, p.inputs.teacher_select)
    finally:
        masked.remove()
    for kl_weight in (1.0, 0.0):  # 0: a cost-only search shrinks everything, so the rival must win
        # without fill there: fill measures its upgrades by KL, and with 8 candidates it grows the shrunk result back
        # past the rival here (11 k -> 60 k parameters), which is no longer a cost-only result
        search = spec.search if kl_weight else dataclasses.replace(spec.search, fill=False)
        res = run_search(p.base.model, p.inputs, p.cost_model, search, LagrangianSettings(), kl_weight=kl_weight)
        alone = run_search(
            p.base.model,
            dataclasses.replace(p.inputs, homogeneous=None),
            p.cost_model,
            search,
            LagrangianSettings(),
            kl_weight=kl_weight,
        )
        assert alone.origin == "search" and alone.architecture == res.searched and alone.kl_select == res.searched_kl_select
        assert res.all_feasible and res.kl_select <= res.searched_kl_select
        assert (res.origin == "homogeneous") == (res.kl_select < res.searched_kl_select)
    assert res.origin == "homogeneous" and res.architecture != res.searched


def test_trials_reuse_the_prepared_rival_measurement_only_when_unchanged(prepared) -> None:  # type: ignore[no-untyped-def]
    """A trial that leaves the prepared rival as it is takes its selection KL from prepare (a marker value here) instead
    of measuring it again; a rival the trial's fill changed is measured."""
    spec, p = prepared
    marked = dataclasses.replace(p.inputs, homogeneous_select=(-1.0, 1.0))
    res = run_search(p.base.model, marked, p.cost_model, dataclasses.replace(spec.search, fill=False), LagrangianSettings())
    assert res.origin == "homogeneous" and res.architecture == p.inputs.homogeneous and res.kl_select == -1.0
    drop_order = block_importance(p.base.model, p.inputs.calib[: spec.search.importance_sequences], progress=False).drop_order()
    narrowest = homogeneous_full_kv(p.space, drop_order, p.cost_model, p.inputs.constraints)[-1]  # room to fill
    unfilled = dataclasses.replace(marked, homogeneous=narrowest)
    res = run_search(p.base.model, unfilled, p.cost_model, spec.search, LagrangianSettings())
    assert res.kl_select >= 0 or res.architecture == narrowest  # the marker only ever stands for the unchanged rival


def test_a_trial_aiming_inside_its_bounds_meets_its_rival_there(prepared) -> None:  # type: ignore[no-untyped-def]
    """The prepared rival sits at the bounds; a trial with margin m > 0 repairs it into the bounds tightened by m
    before comparing (a cheaper point of the front, not back at the bound where the margin-0 trials are). Here
    prepare's measurement is a marker (-1) that would win any comparison: the trial must neither keep the
    prepared rival nor reuse that measurement for the repaired one."""
    spec, p = prepared
    margin = 0.03  # the tiny model's smallest architecture still fits inside; the prepared rival does not
    tight = tuple(c.tightened(margin) for c in p.inputs.constraints)
    at_bound = p.cost_model.predict(p.inputs.homogeneous)
    assert not all(c.satisfied(at_bound[c.metric]) for c in tight)
    marked = dataclasses.replace(p.inputs, homogeneous_select=(-1.0, 1.0))
    res = run_search(p.base.model, marked, p.cost_model, dataclasses.replace(spec.search, fill=False), LagrangianSettings(margin=margin))
    assert res.kl_select >= 0 and res.architecture != p.inputs.homogeneous
    if res.origin == "homogeneous":
        costs = p.cost_model.predict(res.architecture)
        assert all(c.satisfied(costs[c.metric]) for c in tight)


def test_constraint_tightened() -> None:
    upper, lower = Constraint("tpot_ms", 10.0), Constraint("throughput_tok_s", 100.0)
    assert upper.tightened(0.2).value == pytest.approx(8.0) and lower.tightened(0.2).value == pytest.approx(120.0)
    assert upper.tightened(0.0) is upper


def test_evaluate_matches_the_model_own_loss(prepared) -> None:  # type: ignore[no-untyped-def]
    """The unpruned model: KL to itself 0, perplexity exp(the Hugging Face model's own mean next-token loss)."""
    _, p = prepared
    model, tokens = p.base.model, p.inputs.report[:4]
    masked = MaskedModel(model, p.space, p.inputs.ranking)
    try:
        teacher = model.model(input_ids=tokens, use_cache=False).last_hidden_state
        kl, ppl = evaluate(model, masked, None, tokens, teacher, batch_size=2)
    finally:
        masked.remove()
    with torch.no_grad():
        loss = float(model(input_ids=tokens, labels=tokens, use_cache=False).loss)
    assert abs(kl) < 1e-5
    assert ppl == pytest.approx(math.exp(loss), rel=1e-5)


def test_base_perplexity_from_the_teacher_outputs_equals_a_second_forward(prepared) -> None:  # type: ignore[no-untyped-def]
    """prepare takes the unpruned model's report perplexity from the cached teacher outputs (LM head only): the same
    number a whole forward pass through the (cleared) masked model gives."""
    _, p = prepared
    masked = MaskedModel(p.base.model, p.space, p.inputs.ranking)
    try:
        kl, ppl = evaluate(p.base.model, masked, None, p.inputs.report, p.inputs.teacher_report)
    finally:
        masked.remove()
    assert abs(kl) < 1e-6 and p.base_perplexity > 1.0
    assert p.base_perplexity == pytest.approx(ppl, rel=1e-6)


def test_search_can_start_at_the_rival(prepared) -> None:  # type: ignore[no-untyped-def]
    """search.start=rival: before any real step the most probable architecture is the rival, not the base model."""
    spec, p = prepared
    frozen = LagrangianSettings(lr=1e-9, dual_lr=0.0)
    for start, expected in (("rival", p.inputs.homogeneous), ("base", p.space.largest())):
        search = dataclasses.replace(spec.search, steps=1, start=start)
        assert run_search(p.base.model, p.inputs, p.cost_model, search, frozen).argmax == expected


def test_each_bound_is_met(prepared) -> None:  # type: ignore[no-untyped-def]
    spec, p = prepared
    base_ttft = p.cost_model.predict(p.space.largest())["ttft_ms"]
    assert p.cost_model.predict(p.space.smallest())["ttft_ms"] < 0.5 * base_ttft  # both bounds can be met
    results = []
    for share in (0.9, 0.5):
        inputs = dataclasses.replace(p.inputs, constraints=(Constraint("ttft_ms", share * base_ttft),))
        results.append(run_search(p.base.model, inputs, p.cost_model, spec.search, LagrangianSettings()))
    loose, tight = results
    assert loose.all_feasible and tight.all_feasible
    assert loose.costs["ttft_ms"] <= 0.9 * base_ttft and tight.costs["ttft_ms"] <= 0.5 * base_ttft
    assert tight.architecture.num_params() <= loose.architecture.num_params()


def test_settle_pushes_on_until_the_argmax_fits(prepared) -> None:  # type: ignore[no-untyped-def]
    """Multipliers too weak to move the argmax within the schedule: without settling repair must act; with it the argmax fits."""
    spec, p = prepared
    base_ttft = p.cost_model.predict(p.space.largest())["ttft_ms"]
    inputs = dataclasses.replace(p.inputs, constraints=(Constraint("ttft_ms", 0.6 * base_ttft),))
    weak = LagrangianSettings(lambda_init=0.0, dual_lr=0.05)
    plain = run_search(p.base.model, inputs, p.cost_model, spec.search, weak)
    assert plain.settle_steps == 0 and plain.repair_steps > 0
    steps: list[dict[str, float]] = []
    settled = run_search(p.base.model, inputs, p.cost_model, dataclasses.replace(spec.search, settle_steps=100), weak, on_step=steps.append)
    assert 0 < settled.settle_steps < 100 and settled.repair_steps == 0 and settled.all_feasible
    assert len(steps) == spec.search.steps + settled.settle_steps
    assert steps[-1]["lambda_ttft_ms"] > steps[spec.search.steps - 1]["lambda_ttft_ms"]  # the argmax's violation raised it


def smollm2_on_h100():  # type: ignore[no-untyped-def]
    """SmolLM2-135M's search space and the analytic cost model of an H100 batched workload (no model loads)."""
    from autocompress.arch.space import Architecture, SearchSpace
    from autocompress.config.schema import Hardware, SpaceSpec, Workload
    from autocompress.cost import AnalyticCostModel

    from .test_arch import SMOLLM2

    space = SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec())
    hardware = Hardware(name="h", peak_tflops=989.4, mem_bandwidth_gbs=3350, memory_gib=74.5)
    workload = Workload(name="w", prompt_len=1024, output_len=256, concurrency=256, context_len=4096)
    return space, AnalyticCostModel(space, hardware, workload)


def test_repair_reaches_feasibility_and_follows_measured_quality() -> None:
    from autocompress.arch.space import Architecture
    from autocompress.search.differentiable import repair

    space, cm = smollm2_on_h100()
    bound = (Constraint("ttft_ms", 0.8 * cm.predict(space.largest())["ttft_ms"]),)
    flat = (torch.zeros(len(space.hidden)), torch.zeros(30, len(space.attention)), torch.zeros(30, len(space.ffn)), torch.zeros(3))
    fixed, steps = repair(space.largest(), space, cm, bound, flat)
    assert steps > 0 and bound[0].satisfied(cm.predict(fixed)["ttft_ms"])

    def quality(a: Architecture) -> float:  # pruning the hidden size or query heads is ruinous, FFN width cheap
        return 100.0 * (a.hidden_size < 576) + 100.0 * (a.num_attention_heads < 9) + sum(1536 - b.ffn for b in a.blocks) / 1e4

    kept, _ = repair(space.largest(), space, cm, bound, flat, quality=quality, candidates=len(space.ffn) * 30 + 2)
    assert kept.hidden_size == 576 and kept.num_attention_heads == 9 and bound[0].satisfied(cm.predict(kept)["ttft_ms"])

    def heads_cheap(a: Architecture) -> float:  # now the query heads are what costs least quality
        kv = sum(3 - b.kv_heads for b in a.blocks)
        return 100.0 * (a.hidden_size < 576) + kv + sum(1536 - b.ffn for b in a.blocks) / 1e2 + (9 - a.num_attention_heads) / 1e4

    by_heads, _ = repair(space.largest(), space, cm, bound, flat, quality=heads_cheap, candidates=len(space.ffn) * 30 + 2)
    assert by_heads.num_attention_heads < 9 and bound[0].satisfied(cm.predict(by_heads)["ttft_ms"])


def test_fill_spends_slack_without_breaking_the_target() -> None:
    from autocompress.arch.space import Architecture
    from autocompress.search.differentiable import fill

    space, cm = smollm2_on_h100()
    base = cm.predict(space.largest())["ttft_ms"]
    bound = (Constraint("ttft_ms", 0.8 * base),)
    flat = (torch.zeros(len(space.hidden)), torch.zeros(30, len(space.attention)), torch.zeros(30, len(space.ffn)), torch.zeros(3))
    small = space.architecture(
        len(space.hidden) - 1, [len(space.attention) - 1] * 30, [0] * 30, len(space.heads) - 1
    )  # every FFN at its smallest

    def quality(a: Architecture) -> float:  # more FFN is better: every upgrade helps
        return -sum(b.ffn for b in a.blocks) / 1e4

    filled, steps = fill(small, space, cm, bound, flat, quality)
    ttft = cm.predict(filled)["ttft_ms"]
    assert steps > 0 and bound[0].satisfied(ttft) and ttft > cm.predict(small)["ttft_ms"]
    assert all(not bound[0].satisfied(cm.predict(space.architecture(*m))["ttft_ms"]) for m, _ in _upgrades_of(filled, space))

    tight, _ = fill(small, space, cm, bound, flat, quality, margin=0.2)  # aims 20% inside the bound
    assert cm.predict(tight)["ttft_ms"] <= 0.8 * 0.8 * base + 1e-9 and tight.num_params() < filled.num_params()

    same, none = fill(small, space, cm, bound, flat, lambda a: 0.0)  # nothing measured improves: nothing changes
    assert none == 0 and same == small
    over, none = fill(space.largest(), space, cm, bound, flat, quality)  # already over the bound: left to repair
    assert none == 0 and over == space.largest()


def _upgrades_of(arch, space):  # type: ignore[no-untyped-def]
    from autocompress.search.differentiable import _moves

    flat = [torch.zeros(len(space.hidden)), torch.zeros(30, len(space.attention)), torch.zeros(30, len(space.ffn)), torch.zeros(3)]
    return _moves(space.indices(arch), flat, space, +1)


def test_search_respects_the_attention_floor(prepared) -> None:  # type: ignore[no-untyped-def]
    spec, p = prepared
    tight = dataclasses.replace(p.inputs, constraints=tuple(Constraint(c.metric, c.value * 0.97) for c in p.inputs.constraints))
    result = run_search(p.base.model, tight, p.cost_model, spec.search, LagrangianSettings(lambda_init=20.0, dual_lr=5.0))
    assert p.space.allows(result.architecture) and result.architecture.blocks[0].kv_heads > 0


def test_the_start_names_the_base_costs_and_warns_when_nothing_needs_pruning(capsys: pytest.CaptureFixture[str]) -> None:
    """Each bound is printed beside the unpruned model's predicted cost; a scenario the unpruned model already meets
    gets one warning line (pruning buys nothing there) instead of a silent search."""
    loose = compose_spec("+scenario=cpu_interactive", *TINY_CPU, "scenario.constraints.tpot_ms=1.5x", "scenario.constraints.ttft_ms=2x")
    prepare(loose, progress=False)
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if "constraints: " in ln)
    assert "tpot_ms <= 1.5x base" in line and "(base model " in line and ": met)" in line and ": missed)" not in line
    assert sum("already meets every bound" in ln for ln in err.splitlines()) == 1
    prepare(compose_spec("+scenario=cpu_interactive", *TINY_CPU), progress=False)  # 0.97x / 0.9x: the base misses both
    err = capsys.readouterr().err
    assert ": missed)" in err and "already meets every bound" not in err


def test_windows_longer_than_the_models_positions_are_refused_before_the_data() -> None:
    from autocompress.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data\.seq_len=4096 is longer than the model's 2048 positions"):
        prepare(compose_spec("+scenario=cpu_interactive", *TINY_CPU, "data.seq_len=4096"), progress=False)
