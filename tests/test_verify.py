"""Verification of Pareto points in the engine: feasibility from measured medians, and within noise."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from autocompress.config.metrics import Constraint
from autocompress.cost.engine import measured_metrics
from autocompress.results.store import load_pareto, load_trials
from autocompress.verify import measured_columns

from .conftest import TINY_CPU, run_cli

ROW = {
    "status": "ok",
    "ttft_ms": 100.0,
    "tpot_ms": 10.0,
    "throughput_tok_s": 50.0,
    "peak_gib": 2.0,
    "kv_capacity_tokens": 4096,
    "ttft_spread": 0.05,
    "tpot_spread": 0.02,
    "throughput_spread": 0.02,
}


def test_measured_feasibility_strict_and_within_noise() -> None:
    ok = measured_columns([ROW], (Constraint("ttft_ms", 120.0), Constraint("throughput_tok_s", 40.0)))
    assert ok["feasible_measured"] and ok["feasible_within_noise"] and ok["measured_memory_gib"] == 2.0
    # 100 ms against a 97 ms bound: violated, but within the 5% run-to-run spread
    close = measured_columns([ROW], (Constraint("ttft_ms", 97.0),))
    assert not close["feasible_measured"] and close["feasible_within_noise"]
    far = measured_columns([ROW], (Constraint("tpot_ms", 8.0),))
    assert not far["feasible_measured"] and not far["feasible_within_noise"]
    want = {"ttft_ms": 100.0, "tpot_ms": 10.0, "throughput_tok_s": 50.0, "memory_gib": 2.0, "kv_capacity_tokens": 4096.0}
    assert measured_metrics(ROW) == want
    assert {f"measured_{k}": v for k, v in measured_metrics(ROW).items()}.items() <= ok.items()  # compare's columns are verify's
    gpu = measured_columns([ROW | {"host_memory_only": True}], (Constraint("ttft_ms", 120.0), Constraint("memory_gib", 1.0)))
    assert "measured_memory_gib" not in gpu and gpu["unverified_constraints"] == "memory_gib"  # RSS is host memory on a GPU node
    assert gpu["feasible_measured"]  # judged on what was measured; the 1 GiB bound that 2 GiB of RSS would break is not applied
    # with the engine's device accounting a GPU row measures memory from it, never from RSS; a pinned KV cache's
    # capacity is the pin, not a measurement
    device = ROW | {"host_memory_only": True, "device_gib": 1.5, "kv_pinned_gib": 0.25}
    assert measured_metrics(device) == {"ttft_ms": 100.0, "tpot_ms": 10.0, "throughput_tok_s": 50.0, "memory_gib": 1.5}
    judged = measured_columns([device], (Constraint("ttft_ms", 120.0), Constraint("memory_gib", 1.0)))
    assert judged["measured_memory_gib"] == 1.5 and not judged["feasible_measured"] and not judged.get("unverified_constraints")
    broken = measured_columns([ROW | {"host_memory_only": True, "memory_accounting_error": "AttributeError: kv_caches"}], ())
    assert "measured_memory_gib" not in broken and broken["verify_memory_error"] == "AttributeError: kv_caches"  # said, not hidden
    failed = measured_columns([{"status": "failed", "error": "engine died"}], (Constraint("tpot_ms", 8.0),))
    assert failed["verify_status"] == "failed" and not failed["feasible_measured"]


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    out = run_cli("autocompress.verify", str(tmp_path / "pareto.parquet"))
    assert out.returncode == 2 and "does not exist" in out.stderr


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_verify_writes_measured_columns(tmp_path: Path) -> None:
    # vLLM's CPU attention needs head_dim >= 32: 128 hidden / 4 heads
    overrides = [
        *TINY_CPU,
        "model.hidden_size=128",
        "model.intermediate_size=256",
        "search.space.hidden_divisor=32",
        "search.space.ffn_divisor=64",
        "sweep.num_trials=1",
        "profile.repeats=1",
        "profile.warmup=0",
        "profile.single_process=true",  # no two more vLLM processes per engine: the columns are the point here, not deployment timings
    ]
    sweep = run_cli("autocompress.sweep", "+scenario=cpu_interactive", *overrides, f"results.dir={tmp_path}", "results.run_id=v")
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    pareto_path = tmp_path / "cpu_interactive" / "v" / "pareto.parquet"
    written = pareto_path.read_bytes(), (pareto_path.parent / "trials.parquet").read_bytes()
    out = run_cli("autocompress.verify", str(pareto_path), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (pareto_path.read_bytes(), (pareto_path.parent / "trials.parquet").read_bytes()) == written  # the sweep's tables stay
    pareto = load_pareto(pareto_path.parent)  # with verify's own measured.parquet merged in
    assert (pareto["verify_status"] == "ok").all()
    assert (pareto["measured_tpot_ms"] > 0).all() and pareto["feasible_measured"].dtype == bool
    parts = pareto[["measured_weights_gib", "measured_kv_alloc_gib", "measured_runtime_gib"]].sum(axis=1)
    assert (parts - pareto["measured_memory_gib"]).abs().max() < 1e-9 and (pareto["measured_runtime_gib"] > 0).all()
    trials = load_trials(pareto_path.parent)
    assert "measured_ttft_ms" in trials and "measured feasible:" in out.stdout
    assert (pareto_path.parent / "verify" / "measured.parquet").exists() and "the sweep's tables are unchanged" in out.stdout


def test_a_gpu_engine_on_a_cluster_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """verify (or profile) of a GPU scenario where Ray has no GPU: one line naming the two ways on, not actors that wait
    for a device forever (an h100_batched run verified on this CPU machine used to hang in ray.wait)."""
    import ray

    from autocompress.cost.engine import check_devices
    from autocompress.cost.engine_settings import EngineSettings
    from autocompress.errors import ConfigError

    gpu = EngineSettings("vllm", "bf16", 2048, 8, 2048, 1.0)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": False, "Resources": {"GPU": 8.0}}])
    with pytest.raises(ConfigError, match=r"serves this hardware on a GPU and the Ray cluster has none: .*verify\.source=aiconfigurator"):
        check_devices(gpu)
    assert check_devices(dataclasses.replace(gpu, engine="vllm-cpu")) == 1  # one engine per CPU node
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 16.0, "GPU": 2.0}}])
    assert check_devices(gpu) == 2  # one engine per GPU


def test_compare_measure_always_checks_the_device_before_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """compare.measure=always on a GPU scenario where Ray has no GPU: refused when compare starts (it used to come after
    the distillations, and then wait for a GPU forever); auto and never start nothing."""
    import types

    import ray

    from autocompress import cluster
    from autocompress.baselines.comparison import job_from_dict
    from autocompress.compare import check_measurable
    from autocompress.config.compose import compose_dict
    from autocompress.errors import ConfigError

    monkeypatch.setattr(cluster, "init_ray", lambda address=None: None)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}])
    for measure, refused in (("always", True), ("auto", False), ("never", False)):
        job = job_from_dict(compose_dict("+scenario=h100_batched", f"compare.measure={measure}"))
        ctx = types.SimpleNamespace(spec=job.spec, hybrid=False)
        if refused:
            with pytest.raises(ConfigError, match="serves this hardware on a GPU and the Ray cluster has none"):
                check_measurable(job, ctx)  # type: ignore[arg-type]
        else:
            check_measurable(job, ctx)  # type: ignore[arg-type]
