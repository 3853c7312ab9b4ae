"""`python -m autocompress.profile +scenario=NAME`: measure architectures in vLLM, fit and validate the cost model.

Design of experiments over the search space (the base model, the smallest architecture, uniform
shrinks, random heterogeneous ones with no-op layers; a share of the random ones held out), each
measured on the scenario's workload (and `profile.extra_workloads`) in a fresh Ray actor owning
one device. Measurements accumulate in results/cost_models/measurements/<hardware>__<engine>.parquet
(an interrupted run resumes without re-measuring); the fit lands in a versioned JSON file beside it
and is used automatically by later sweeps on that hardware.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import pandas as pd
from omegaconf import DictConfig

from autocompress.arch import Architecture, SearchSpace
from autocompress.baselines import uniform_shrink
from autocompress.cliargs import hydra_entry
from autocompress.cliargs import task as hydra_task
from autocompress.compose import load_workload, plain
from autocompress.config import Hardware, RunSpec, Workload, run_spec_from_dict
from autocompress.cost.fitted import Measurement, fit_parameters, model_dir, ranges, save_record, validate
from autocompress.cpuinfo import identity
from autocompress.decilm import vllm_limitation
from autocompress.engine import EngineSettings, arch_id, engine_settings, measure_many, require_vllm
from autocompress.errors import AutoCompressError, ConfigError
from autocompress.models import load_base_model
from autocompress.prepare import log
from autocompress.raycluster import init_ray
from autocompress.results import write_parquet

MEASURED = ("ttft_ms", "tpot_ms", "throughput_tok_s", "kv_capacity_tokens")


# --------------------------------------------------------------------------- design of experiments


def random_architecture(space: SearchSpace, rng: random.Random) -> Architecture:
    """Independent random options per decision; a no-op is as likely as any width."""
    att = [rng.randrange(floor, len(space.attention)) for floor in space.attention_floor]
    ffn = [rng.randrange(len(space.ffn)) for _ in range(space.num_layers)]
    return space.architecture(rng.randrange(len(space.hidden)), att, ffn, rng.randrange(len(space.heads)))


def design(
    space: SearchSpace, n_random: int, holdout_share: float, fractions: tuple[float, ...], seed: int
) -> list[tuple[Architecture, str]]:
    """(architecture, role) pairs: role "fit" or "holdout" (never used in the fit)."""
    fixed = [space.largest(), space.smallest(), *(uniform_shrink(space, f) for f in fractions)]
    rng, randoms = random.Random(seed), list[Architecture]()
    while len(randoms) < n_random:
        arch = random_architecture(space, rng)
        if vllm_limitation(arch) is None and arch not in randoms:
            randoms.append(arch)
    n_hold = round(holdout_share * n_random)
    out, seen = [], set()
    for arch, role in [*((a, "fit") for a in fixed), *((a, "holdout") for a in randoms[:n_hold]), *((a, "fit") for a in randoms[n_hold:])]:
        if arch not in seen:
            seen.add(arch)
            out.append((arch, role))
    return out


# --------------------------------------------------------------------------- measurements file


def measurements_path(results_dir: str | Path, hardware: Hardware) -> Path:
    """One file per hardware + engine (+ CPU: measurements of one CPU never stand in for another's)."""
    cpu = f"__{hardware.cpu}" if hardware.cpu else ""
    return model_dir(results_dir) / "measurements" / f"{hardware.name}__{hardware.engine}{cpu}.parquet"


def load_measurements(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path) if path.exists() else pd.DataFrame()


def _done(table: pd.DataFrame) -> set[tuple[str, str]]:
    if table.empty:
        return set()
    return set(zip(table["arch_id"], table["workload"], strict=True))


def _row_meta(arch: Architecture, role: str, wl: Workload, spec: RunSpec, settings: EngineSettings) -> dict[str, Any]:
    return {
        "arch_id": arch_id(arch),
        "architecture": arch.to_json(),
        "role": role,
        "params": arch.num_params(),
        "workload": wl.name,
        "prompt_len": wl.prompt_len,
        "output_len": wl.output_len,
        "concurrency": wl.concurrency,
        "dtype": wl.dtype,
        "hardware": spec.scenario.hardware.name,
        "cpu": spec.scenario.hardware.cpu,
        "engine": settings.engine,
        "model": spec.model.name,
        "kv_cache_gib": settings.kv_cache_gib,
        "measured_at": dt.datetime.now().isoformat(timespec="seconds"),
    }


def run_measurements(
    spec: RunSpec, plan: list[tuple[Architecture, str]], workloads: list[Workload], settings: EngineSettings
) -> pd.DataFrame:
    """Measure every (architecture, workload) not in the measurements file yet; append after each architecture."""
    path = measurements_path(spec.results_dir, spec.scenario.hardware)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = load_measurements(path)
    base_config = load_base_model(spec.model).model.config.to_dict()
    todo = [(a, r) for a, r in plan if any((arch_id(a), w.name) not in _done(table) for w in workloads)]
    log(f"profiling {len(todo)} of {len(plan)} architectures ({len(plan) - len(todo)} already measured) on {[w.name for w in workloads]}")
    init_ray(spec.sweep.ray_address)
    roles, by_name, start = dict(todo), {w.name: w for w in workloads}, time.time()
    for n, (arch, rows) in enumerate(measure_many([a for a, _ in todo], base_config, workloads, settings), 1):
        new = pd.DataFrame([{**_row_meta(arch, roles[arch], by_name[r["workload"]], spec, settings), **r} for r in rows])
        if not table.empty:  # a re-measured architecture replaces its earlier rows
            table = table[table["arch_id"] != arch_id(arch)]
        table = pd.concat([table, new], ignore_index=True) if not table.empty else new
        write_parquet(table, path)
        status = ", ".join(f"{r['workload']}: {_summary(r)}" for r in rows)
        elapsed = time.time() - start
        log(f"[{n}/{len(todo)}] {arch_id(arch)} ({roles[arch]}, {arch.num_params() / 1e6:.1f}M) {status} ({elapsed:.0f}s elapsed)")
    return table


def _summary(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return "FAILED " + str(row.get("error", "")).splitlines()[-1][:120]
    return f"ttft {row['ttft_ms']:.0f}ms tpot {row['tpot_ms']:.1f}ms thr {row['throughput_tok_s']:.0f}tok/s"


# --------------------------------------------------------------------------- fit


def to_measurements(table: pd.DataFrame, role: str, workloads: dict[str, Workload]) -> list[Measurement]:
    ok = table[(table["status"] == "ok") & (table["role"] == role) & table["workload"].isin(list(workloads))]
    return [
        Measurement(Architecture.from_json(r.architecture), workloads[r.workload], {k: float(getattr(r, k)) for k in MEASURED})
        for r in ok.itertuples()
    ]


def fit_and_save(spec: RunSpec, space: SearchSpace, table: pd.DataFrame, workloads: list[Workload], settings: EngineSettings) -> Path:
    """Fit on role=fit, validate on role=holdout, save a versioned model; print the validation table."""
    hw = dataclasses.replace(spec.scenario.hardware, kv_cache_gib=settings.kv_cache_gib if settings.engine == "vllm-cpu" else None)
    by_name = {w.name: w for w in workloads}
    fit_data, hold = to_measurements(table, "fit", by_name), to_measurements(table, "holdout", by_name)
    if len(fit_data) < 3:
        raise ConfigError(
            f"only {len(fit_data)} successful fit measurements; at least 3 are needed (see the measurements file for failures)"
        )
    params = fit_parameters(space, hw, fit_data)
    fitted_hw = dataclasses.replace(hw, **params)  # type: ignore[arg-type]
    ok = table[table["status"] == "ok"]
    record = {
        "hardware": hw.name,
        "cpu": hw.cpu,
        "cpu_identity": identity() if hw.cpu else None,
        "engine": settings.engine,
        "engine_version": str(ok["engine_version"].iloc[0]) if "engine_version" in ok else None,
        "dtype": settings.dtype,
        "enforce_eager": settings.enforce_eager,
        "kv_cache_gib": hw.kv_cache_gib,
        "model": spec.model.name,
        "workloads": [dataclasses.asdict(w) for w in workloads],
        "parameters": {**params, "kv_cache_gib": hw.kv_cache_gib, "peak_tflops": hw.peak_tflops, "mem_bandwidth_gbs": hw.mem_bandwidth_gbs},
        "ranges": ranges(fit_data + hold),
        "n_fit": len(fit_data),
        "n_holdout": len(hold),
        "validation": validate(space, fitted_hw, hold),
        "validation_analytic": validate(space, hw, hold),
        "noise": {k: float(ok[k].median()) for k in ("ttft_spread", "tpot_spread", "throughput_spread") if k in ok},
        "profiling_minutes": profiling_minutes(ok),
        "measurements": str(measurements_path(spec.results_dir, spec.scenario.hardware)),
    }
    path = save_record(record, spec.results_dir)
    print_validation(record)
    print(f"\ncost model: {path}")
    return path


def profiling_minutes(ok: pd.DataFrame) -> dict[str, float]:
    """Engine start + all workloads, per architecture (median) and for the whole design."""
    per_arch = ok.groupby("arch_id").agg(start=("engine_start_s", "first"), measure=("measure_s", "sum")).sum(axis=1) / 60
    return {"per_architecture_median": float(per_arch.median()), "total": float(per_arch.sum()), "architectures": len(per_arch)}


def print_validation(record: dict[str, Any]) -> None:
    print(f"\nheld-out validation ({record['n_holdout']} measurements; fit on {record['n_fit']}):")
    print(f"{'metric':<20}{'MAPE %':>9}{'max %':>9}{'<=10% share':>13}{'Spearman':>10}{'analytic MAPE %':>17}")
    for key, v in record["validation"].items():
        before = record["validation_analytic"].get(key, {}).get("mape", float("nan"))
        print(f"{key:<20}{v['mape']:>9.2f}{v['max_error']:>9.2f}{v['within_10']:>13.0f}{v['spearman']:>10.3f}{before:>17.2f}")
    noise = ", ".join(f"{k} {100 * v:.1f}%" for k, v in record["noise"].items())
    print(f"run-to-run spread (median of (max-min)/median over repeats): {noise}")
    minutes = record["profiling_minutes"]
    per, total, n = minutes["per_architecture_median"], minutes["total"], minutes["architectures"]
    print(f"profiling: {per:.1f} min per architecture, {total:.0f} min for {n} architectures")


# --------------------------------------------------------------------------- entry point


def run_profile(spec: RunSpec) -> Path | None:
    hw = spec.scenario.hardware
    workloads = [spec.scenario.workload, *(load_workload(n) for n in spec.profile.extra_workloads)]
    kv = spec.profile.kv_cache_gib or hw.kv_cache_gib or 1.0
    settings = engine_settings(hw, workloads, kv, spec.profile.repeats, spec.profile.warmup)
    settings = dataclasses.replace(settings, timeout_s=spec.profile.timeout_s, enforce_eager=spec.profile.enforce_eager)
    path = measurements_path(spec.results_dir, hw)
    if not spec.profile.measure and load_measurements(path).empty:
        raise ConfigError(
            f"profile.measure=false, but {path} holds no measurements to fit; drop profile.measure=false to measure first "
            f"(or set results.dir to the folder that holds them)"
        )
    base = load_base_model(spec.model).model
    space = SearchSpace.from_base(Architecture.from_llama_config(base.config), spec.search.space)
    plan = design(space, spec.profile.n_random, spec.profile.holdout_share, spec.profile.uniform_fractions, spec.profile.seed)
    table = load_measurements(path)
    if spec.profile.measure:
        require_vllm(hw.engine)
        table = run_measurements(spec, plan, workloads, settings)
    if not spec.profile.fit:
        return None
    return fit_and_save(spec, space, table, workloads, settings)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
@hydra_task
def main(cfg: DictConfig) -> None:
    try:
        run_profile(run_spec_from_dict(plain(cfg)))
    except AutoCompressError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    hydra_entry(main)
