"""Issue 11 item 6: the Minitron baseline for hybrid MoE models (GraniteMoeHybrid), as ModelOpt's mcore_minitron prunes them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autocompress.arch.moe_pruning import MoEShape, prune
from autocompress.baselines import minitron_moe
from autocompress.baselines.minitron import MinitronSpec
from autocompress.search.moe import grid
from tests.test_moe_pruning import random_model


@pytest.fixture(scope="module")
def model_and_tokens() -> tuple[Any, torch.Tensor]:
    return random_model(), torch.randint(1, 512, (6, 32), generator=torch.Generator().manual_seed(1))


def test_expert_importance_is_modelopts_mean_output_norm(model_and_tokens: tuple[Any, torch.Tensor]) -> None:
    """Per expert: the mean over its routed tokens of |router weight x expert output|, recomputed here by hand for one layer."""
    model, tokens = model_and_tokens
    imp = minitron_moe.modelopt_importance(model, tokens, batch_size=6)
    layer = model.model.layers[3]
    captured: list[torch.Tensor] = []
    handle = layer.block_sparse_moe.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    with torch.no_grad():
        model(tokens, use_cache=False)
    handle.remove()
    moe = layer.block_sparse_moe
    x = captured[0].reshape(-1, model.config.hidden_size)
    index, weights, _ = moe.router(x)
    for e in range(model.config.num_local_experts):
        rows, k = (index == e).nonzero(as_tuple=True)
        if not len(rows):
            assert float(imp.experts[3][e]) == 0.0
            continue
        gate, up = torch.nn.functional.linear(x[rows], moe.experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(moe.experts.act_fn(gate) * up, moe.experts.down_proj[e]) * weights[rows, k, None]
        assert float(imp.experts[3][e]) == pytest.approx(float(y.norm(dim=-1).mean()), rel=1e-5)
    assert imp.layers.shape == (model.config.num_hidden_layers,) and bool((imp.layers > 0).all())
    assert imp.shared_ffn[0].shape == (model.config.shared_intermediate_size,)


def test_the_grid_is_modelopts_at_its_default_limits(model_and_tokens: tuple[Any, torch.Tensor]) -> None:
    cfg = model_and_tokens[0].config  # 8 experts (top-2) of FFN 128, shared FFN 256, 6 layers
    g = minitron_moe.modelopt_grid(cfg, grid(cfg), 0.4, 0.2)
    # choices 1..8: sorted(choices)[int(0.6 * 8):] = 5..8; FFN steps of 16 (128 / 8): 80..128; shared 160..256
    assert g["experts"] == [5, 6, 7, 8] and g["expert_ffn"] == [80, 96, 112, 128] and g["shared_ffn"] == [160, 192, 224, 256]
    assert g["layers"] == [6]  # layer counts 2, 4, 6: int(0.8 * 3) = 2 leaves only the full depth
    assert minitron_moe.modelopt_grid(cfg, grid(cfg), 0.4, 0.4)["layers"] == [4, 6]
    # the router's top-k bounds the expert count from below whatever the limit
    assert min(minitron_moe.modelopt_grid(cfg, grid(cfg), 0.9, 0.2)["experts"]) == cfg.num_experts_per_tok


def test_depth_drops_the_lowest_scored_layers_whatever_their_kind() -> None:
    scores = torch.tensor([2.0, 0.3, 0.01, 0.05, 0.06, 0.04])  # layers 2 and 5 are the tiny model's attention layers
    assert minitron_moe.kept_layers(scores, 4) == (0, 1, 3, 4)
    assert minitron_moe.kept_layers(scores, 6) == (0, 1, 2, 3, 4, 5)
    assert minitron_moe.kept_layers(torch.ones(4), 2) == (0, 1)  # ties: the later layers go


def test_the_pick_is_the_best_scored_of_the_largest_feasible(model_and_tokens: tuple[Any, torch.Tensor]) -> None:
    from autocompress.arch.hybrid import HybridModel
    from autocompress.config.compose import compose_spec
    from autocompress.config.metrics import Constraint
    from autocompress.cost.hybrid import HybridCost

    model, tokens = model_and_tokens
    scenario = compose_spec("+scenario=b200_longctx").scenario
    cost = HybridCost(HybridModel.from_granite(model.config, name="random"), scenario.hardware, scenario.workload)
    types = list(model.config.layer_types)
    base = minitron_moe.price(cost, types, [MoEShape.of(model.config)], ()).loc[0]
    # a bound that narrower experts meet within ModelOpt's limits (no depth pruning): 0.9999x the base's TPOT
    bound = (Constraint("tpot_ms", 0.9999 * float(base["tpot_ms"])),)
    spec = MinitronSpec(top_k=4, importance_sequences=6)
    res = minitron_moe.search(model, cost, bound, tokens, tokens[:3], spec, progress=False)
    assert len(res.scored) == 4 and int(res.scored["chosen"].sum()) == 1
    assert res.scored["params"].is_monotonic_decreasing and (res.scored["tpot_ms"] <= bound[0].value).all()
    pick = res.scored[res.scored["chosen"]].iloc[0]
    assert pick["kl"] == res.scored["kl"].min() and res.best.layers == tuple(pick["layers"])
    assert res.limits["max_width_pruning"] == 0.4 and res.limits["max_depth_pruning"] == 0.2 and not res.limits["widened"]
    # the recorded KL is the pruned model's, on the score tokens
    from autocompress.search.moe import kl_and_perplexity, logits_of

    kl, _ = kl_and_perplexity(prune(model, res.best, res.importance), tokens[:3], logits_of(model, tokens[:3]))
    assert kl == pytest.approx(float(pick["kl"]), rel=1e-9)
    budgeted = minitron_moe.search(model, cost, bound, tokens, tokens[:3], MinitronSpec(budget=2, importance_sequences=6), progress=False)
    assert list(budgeted.scored["params"]) == list(res.scored["params"][:2])  # compare.minitron.budget: the 2 largest


def test_base_perplexity_in_one_pass_equals_the_two_pass_score(model_and_tokens: tuple[Any, torch.Tensor]) -> None:
    """prepare_moe takes the unpruned model's report perplexity in one pass (it took the teacher's logits, then a second pass)."""
    from autocompress.search.moe import kl_and_perplexity, logits_of, perplexity

    model, tokens = model_and_tokens
    teacher = logits_of(model, tokens)
    kl, ppl = kl_and_perplexity(model, tokens, teacher)
    assert kl == pytest.approx(0.0, abs=1e-6)
    assert perplexity(model, tokens, batch_size=4) == pytest.approx(ppl, rel=1e-6)  # 6 rows: batches of 4 and 2


def test_kl_and_perplexity_are_their_definitions_for_a_pruned_model(model_and_tokens: tuple[Any, torch.Tensor]) -> None:
    """Mean over all tokens of sum_v p_t (log p_t - log p_s), and exp of the mean next-token NLL, written out by hand, in
    batches of 4 and 2 (the token sum is rebuilt from each batch's mean)."""
    from autocompress.search.moe import kl_and_perplexity, logits_of

    model, tokens = model_and_tokens
    full = MoEShape.of(model.config)
    student = prune(
        model,
        MoEShape(full.experts, full.expert_ffn // 2, full.shared_ffn, full.layers[1:]),
        minitron_moe.modelopt_importance(model, tokens, batch_size=6),
    )
    kl, ppl = kl_and_perplexity(student, tokens, logits_of(model, tokens), batch_size=4)
    with torch.no_grad():
        logp_t = torch.log_softmax(model(tokens, use_cache=False).logits.double(), dim=-1)
        logp_s = torch.log_softmax(student(tokens, use_cache=False).logits.double(), dim=-1)
    want_kl = float((logp_t.exp() * (logp_t - logp_s)).sum(-1).mean())
    want_ppl = float(torch.exp(-logp_s[:, :-1].gather(-1, tokens[:, 1:, None]).mean()))
    assert want_kl > 0.01 and kl == pytest.approx(want_kl, rel=1e-5) and ppl == pytest.approx(want_ppl, rel=1e-5)
