"""aiconfigurator-core as a cost-data source: the block-wise adapter, the fit to its estimates, the shipped fits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from autocompress.arch.space import Architecture, Block, SearchSpace
from autocompress.config.compose import load_workload
from autocompress.config.schema import SpaceSpec
from autocompress.cost import FittedCostModel, get_cost_model
from autocompress.cost.aic import Estimator
from autocompress.cost.design import design, estimate_design, fit_aiconfigurator
from autocompress.cost.fitted import load_record
from autocompress.errors import ConfigError
from autocompress.profile import profile_aiconfigurator

from .conftest import compose_spec
from .test_arch import SMOLLM2

WORKLOAD = load_workload("batched_serving")


def llama(kv: int, heads: int, layers: int = 30) -> Architecture:
    return Architecture(576, heads, 64, 49152, True, tuple(Block(kv, 1536) for _ in range(layers)))


@pytest.fixture(scope="module")
def h100() -> Estimator:
    return Estimator("h100_sxm")


def test_blockwise_estimate_is_aiconfigurators_whole_model_estimate(h100: Estimator, tmp_path: Path) -> None:
    """A homogeneous model the tables hold (8 query, 4 KV heads): the sum of one-layer blocks equals its own static run."""
    from aiconfigurator_core.sdk.engine import EngineHandle

    arch = llama(kv=4, heads=8)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 30, "vocab_size": 49152,
              "max_position_embeddings": 131072, "hidden_act": "silu", "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    ctx, gen, _ = EngineHandle.compile(str(tmp_path), "h100_sxm", "vllm", backend_version="0.24.0").run_static(
        batch_size=8, isl=1024, osl=256
    )
    got = h100.estimate(arch, WORKLOAD, batch=8)
    assert got["ttft_ms"] == pytest.approx(ctx, rel=1e-9) and got["tpot_ms"] == pytest.approx(gen / 255, rel=1e-9)


def test_kv_heads_the_tables_lack_are_interpolated_and_no_op_blocks_cost_nothing(h100: Estimator) -> None:
    """3 KV heads (SmolLM2's) lie in no table: linear between 2 and 4, recorded; a dropped FFN removes exactly its block."""
    two, three, four = (h100.estimate(llama(kv, 6), WORKLOAD, 8) for kv in (2, 3, 4))
    assert 3 in h100.interpolated_kv and 2 not in h100.interpolated_kv
    for key in ("ttft_ms", "tpot_ms"):
        assert two[key] < three[key] < four[key]
        assert three[key] == pytest.approx((two[key] + four[key]) / 2, rel=1e-9)
    arch = llama(kv=2, heads=6)
    dropped = dataclasses.replace(arch, blocks=(Block(2, 0), *arch.blocks[1:]))
    block = h100.ffn(arch, 1536, 8, WORKLOAD.prompt_len, WORKLOAD.output_len, (None, None))
    assert h100.estimate(dropped, WORKLOAD, 8)["tpot_ms"] == pytest.approx(two["tpot_ms"] - block[1], rel=1e-9)


def test_the_fit_to_estimates_keeps_the_step_overheads_and_is_used_by_auto(tmp_path: Path) -> None:
    """profile.source=aiconfigurator on SmolLM2's space: per-step overheads added and held fixed, held-out MAPE < 5 %, auto picks it."""
    spec = compose_spec("+scenario=h100_batched", f"results.dir={tmp_path}", "profile.source=aiconfigurator")
    space = SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec())
    plan = design(space, n_random=12, holdout_share=0.34, fractions=(0.35, 0.6), seed=0)
    table = estimate_design(spec, space, plan, [spec.scenario.workload])
    ok = table[table["status"] == "ok"]
    assert len(ok) == len(plan) and (ok["source"] == "aiconfigurator-core 0.12.0, vllm 0.24.0 tables, h100_sxm").all()
    assert (ok["tpot_ms"] - ok["aic_tpot_ms"]).round(9).eq(spec.scenario.hardware.step_overhead_ms).all()
    path = fit_aiconfigurator(spec, space, table, [spec.scenario.workload])
    record = load_record(path)
    assert record["parameters"]["step_overhead_ms"] == spec.scenario.hardware.step_overhead_ms and record["fixed"]
    assert all(record["validation"][k]["mape"] < 5 for k in ("ttft_ms", "tpot_ms", "throughput_tok_s"))
    assert record["validation_analytic"]["ttft_ms"]["mape"] > 10  # the datasheet priors alone were far off
    cm = get_cost_model(space, spec.scenario, tmp_path)
    assert isinstance(cm, FittedCostModel) and cm.id == "fitted/h100_sxm/vllm/v1/aiconfigurator"


def test_shipped_fits_are_used_on_a_fresh_clone(tmp_path: Path) -> None:
    """Nothing under results/: auto takes the package's fit for the GPU, with the scenario's own workload terms; RTX cards are derived."""
    space = SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec())
    for scenario, expected in [
        ("h100_batched", "fitted/h100_sxm/vllm/v1/aiconfigurator"),
        ("b200_longctx", "fitted/b200/vllm/v1/aiconfigurator"),
        ("rtx5070_coding", "fitted/rtx5070/vllm/v1/aiconfigurator/derived:rtx_pro_6000_server"),
        ("rtx5080_game", "fitted/rtx5080/vllm/v1/aiconfigurator/derived:rtx_pro_6000_server"),
    ]:
        sc = compose_spec(f"+scenario={scenario}").scenario
        cm = get_cost_model(space, sc, tmp_path)
        assert isinstance(cm, FittedCostModel) and cm.id == expected
        assert cm.parameters == cm.record["by_workload"][sc.workload.name]
        assert cm.parameters["peak_tflops"] == sc.hardware.peak_tflops  # a derived card keeps its own datasheet peaks
    h200 = compose_spec("+scenario=h100_batched", "hardware=h200").scenario
    assert get_cost_model(space, h200, tmp_path).id == "fitted/h200/vllm/v1/aiconfigurator"


def test_hardware_without_tables_is_refused_in_one_line(tmp_path: Path) -> None:
    spec = compose_spec("+scenario=cpu_interactive", f"results.dir={tmp_path}", "profile.source=aiconfigurator")
    with pytest.raises(ConfigError, match=r"names no aiconfigurator system.*use profile\.source=engine"):
        profile_aiconfigurator(spec, [spec.scenario.workload])
    with pytest.raises(ConfigError, match=r"profile\.source must be engine or aiconfigurator"):
        compose_spec("+scenario=h100_batched", "profile.source=gpu")
    assert not list(tmp_path.iterdir())  # nothing written


def gpu_run(folder: Path, scenario: str, constraints: dict[str, float]) -> Path:
    """A finished run folder of a GPU scenario with two SmolLM2 Pareto points (the base model and half of it)."""
    from omegaconf import OmegaConf

    from autocompress.arch.space import uniform_shrink
    from autocompress.config.compose import compose_dict

    folder.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(compose_dict(f"+scenario={scenario}", f"results.dir={folder.parent}")), folder / "config.yaml")
    meta = {"constraints": {m: {"value": v} for m, v in constraints.items()}}
    (folder / "metadata.json").write_text(json.dumps(meta))
    space = SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec())
    archs = [space.largest(), uniform_shrink(space, 0.5)]
    rows = [
        {"trial_id": f"t{i}", "status": "ok", "architecture": a.to_json(), "feasible": True, "ttft_ms": 1.0}
        | {"kl_select": 0.1 * i, "kl": 0.1 * i, "params": a.num_params()}  # as a sweep writes them (results.runcheck reads them)
        for i, a in enumerate(archs)
    ]
    pd.DataFrame(rows).to_parquet(folder / "pareto.parquet")
    return folder


def test_verify_from_aiconfigurator_writes_estimated_columns_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """verify.source=aiconfigurator: estimated_* and feasible_estimated beside the predictions, no measured_* column; a tight TPOT
    bound fails the base model and not its half; a derived card is refused."""
    from autocompress.results.store import with_verified
    from autocompress.verify import main

    run = gpu_run(tmp_path / "h100_batched" / "r1", "h100_batched", {"tpot_ms": 4.0})
    main([str(run), "verify.source=aiconfigurator"])
    table = with_verified(run, pd.read_parquet(run / "pareto.parquet")).set_index("trial_id")  # verify's own file merged in
    assert not [c for c in table.columns if c.startswith("measured_")] and (run / "verify" / "estimated.parquet").exists()
    assert table["estimated_tpot_ms"]["t0"] > table["estimated_tpot_ms"]["t1"] > 1.0  # the step overhead is in
    assert list(table["feasible_estimated"]) == [False, True]
    assert table["estimated_source"].str.startswith("aiconfigurator-core 0.12.0, vllm 0.24.0 tables, h100_sxm").all()
    estimated = (run / "verify" / "estimated.parquet").read_bytes()
    with pytest.raises(SystemExit) as again:  # the same trials again: their rows are not replaced unless asked
        main([str(run), "verify.source=aiconfigurator"])
    assert again.value.code == 2 and (run / "verify" / "estimated.parquet").read_bytes() == estimated
    assert "estimated.parquet already holds rows of t0, t1; choose another out=DIR, or add overwrite=true" in capsys.readouterr().err
    main([str(run), "verify.source=aiconfigurator", "overwrite=true"])
    assert pd.read_parquet(run / "verify" / "estimated.parquet")["trial_id"].tolist() == ["t0", "t1"]
    derived = gpu_run(tmp_path / "rtx5070_coding" / "r1", "rtx5070_coding", {"tpot_ms": 5.0})
    before = (derived / "pareto.parquet").read_bytes()
    with pytest.raises(SystemExit) as exc:
        main([str(derived), "verify.source=aiconfigurator"])
    assert exc.value.code == 2 and (derived / "pareto.parquet").read_bytes() == before and not (derived / "verify").exists()


def test_verify_from_aiconfigurator_judges_relative_bounds_against_its_own_base_estimate(tmp_path: Path) -> None:
    """h100_batched asks throughput >= 1.5x base and TTFT <= 0.7x base: judged by aiconfigurator, "base" is its estimate
    of the base model, not the sweep's cost model's prediction (the absolute values the run folder holds, made absurd here)."""
    from autocompress.verify import main

    run = gpu_run(tmp_path / "h100_batched" / "r1", "h100_batched", {"throughput_tok_s": 1.0, "ttft_ms": 1e9})
    written = (run / "pareto.parquet").read_bytes()
    main([str(run), "verify.source=aiconfigurator"])
    assert (run / "pareto.parquet").read_bytes() == written  # verify writes its own file, never the sweep's tables
    estimated = pd.read_parquet(run / "verify" / "estimated.parquet")
    table = pd.read_parquet(run / "pareto.parquet").merge(estimated, on="trial_id").set_index("trial_id")  # t0: the base model
    assert table["estimated_bound_throughput_tok_s"]["t0"] == pytest.approx(1.5 * table["estimated_throughput_tok_s"]["t0"])
    assert table["estimated_bound_ttft_ms"]["t1"] == pytest.approx(0.7 * table["estimated_ttft_ms"]["t0"])
    assert not table["feasible_estimated"]["t0"]  # the base model is never 1.5x itself


def test_a_run_judged_by_the_analytic_model_keeps_it_after_fits_ship() -> None:
    """compare on a GPU run swept before the shipped fits: auto resolves to what judged its trials, not to the new fit."""
    from autocompress.baselines.context import cost_model_choice

    assert cost_model_choice("auto", "analytic/h100_sxm/v1") == "analytic"
    assert cost_model_choice("auto", "fitted/h100_sxm/vllm/v1/aiconfigurator") == "auto"
    assert cost_model_choice("/a/fit.json", "analytic/h100_sxm/v1") == "/a/fit.json"  # an explicit choice stays


def test_an_fp8_kv_cache_is_estimated_apart_from_the_weights_dtype(h100: Estimator) -> None:
    """workload.kv_dtype=fp8 with bf16 weights: aiconfigurator's fp8-KV tables (decode reads half the cache bytes),
    not the bf16 ones, and not its fp8-GEMM tables either (the weights stay bf16)."""
    arch = llama(kv=4, heads=8)
    bf16 = h100.estimate(arch, WORKLOAD, batch=64)
    fp8_kv = h100.estimate(arch, dataclasses.replace(WORKLOAD, kv_dtype="fp8"), batch=64)
    fp8_all = h100.estimate(arch, dataclasses.replace(WORKLOAD, dtype="fp8", kv_dtype="fp8"), batch=64)
    assert fp8_kv["tpot_ms"] < 0.95 * bf16["tpot_ms"]
    assert fp8_kv["tpot_ms"] != pytest.approx(fp8_all["tpot_ms"], rel=1e-3)
