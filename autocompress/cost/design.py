"""Profiling a serving engine: the design of experiments, the measurements file, and fitting a cost model to measurements
(vLLM runs) or to aiconfigurator's estimates."""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from autocompress.arch.space import Architecture, SearchSpace, uniform_shrink
from autocompress.cluster import init_ray
from autocompress.config.cpuinfo import identity
from autocompress.config.metrics import ENGINE_MEASURED
from autocompress.config.schema import Hardware, RunSpec, Workload
from autocompress.cost.engine import EngineSettings, arch_id, measure_many
from autocompress.cost.fitted import (
    FITTED,
    Measurement,
    fit_parameters,
    model_dir,
    predictions,
    ranges,
    save_record,
    validate,
    validate_each,
)
from autocompress.cost.waves import mape_interval, median_noise_summary
from autocompress.errors import ConfigError
from autocompress.io import log, write_parquet
from autocompress.model.base import load_base_model
from autocompress.model.decilm import vllm_limitation

MEASURED = ENGINE_MEASURED  # what a profiling wave measures (config.metrics)


# --------------------------------------------------------------------------- design of experiments


def random_architecture(space: SearchSpace, rng: random.Random, level: float | None = None) -> Architecture:
    """Independent random options per decision; a no-op is as likely as any width.

    With `level` in [0, 1], each decision's option is drawn within two options of that share of its
    range instead, so that a design of levels spread over [0, 1] spans small to large architectures
    (still heterogeneous layer by layer) rather than crowding around the middle size.
    """

    def pick(n: int, floor: int = 0) -> int:
        if level is None:
            return rng.randrange(floor, n)
        return min(n - 1, max(floor, round(floor + level * (n - 1 - floor) + rng.uniform(-2, 2))))

    att = [pick(len(space.attention), floor) for floor in space.attention_floor]
    ffn = [pick(len(space.ffn)) for _ in range(space.num_layers)]
    return space.architecture(pick(len(space.hidden)), att, ffn, pick(len(space.heads)))


def design(
    space: SearchSpace, n_random: int, holdout_share: float, fractions: tuple[float, ...], seed: int
) -> list[tuple[Architecture, str]]:
    """(architecture, role) pairs: role "fit" or "holdout" (never used in the fit).

    The random architectures take stratified size levels (level k of n drawn in [k/n, (k+1)/n)). The
    held-out ones are spaced evenly by parameter count from the smallest random one to the largest,
    so validation spans the whole range, not only its middle; the fit takes the ones in between.
    """
    fixed = [space.largest(), space.smallest(), *(uniform_shrink(space, f) for f in fractions)]
    rng, randoms = random.Random(seed), list[Architecture]()
    levels = [(k + rng.random()) / max(n_random, 1) for k in range(n_random)]
    tries = 0
    while len(randoms) < n_random:
        tries += 1  # a small space can run out of new architectures near one level: then any level
        arch = random_architecture(space, rng, levels[len(randoms)] if tries < 50 else None)
        if vllm_limitation(arch) is None and arch not in randoms:
            randoms.append(arch)
            tries = 0
    by_size = sorted(randoms, key=lambda a: a.num_params())
    held = {by_size[k] for k in spaced_indices(n_random, round(holdout_share * n_random))}
    roles = [(a, "holdout" if a in held else "fit") for a in randoms]
    out, seen = [], set()
    for arch, role in [*((a, "fit") for a in fixed), *sorted(roles, key=lambda r: r[1] != "holdout")]:
        if arch not in seen:
            seen.add(arch)
            out.append((arch, role))
    return out


def spaced_indices(n: int, k: int) -> set[int]:
    """`k` of range(n) spaced evenly from the first to the last (the middle one when k is 1)."""
    if k <= 0 or n <= 0:
        return set()
    if k >= n:
        return set(range(n))
    if k == 1:
        return {n // 2}
    return {round(i * (n - 1) / (k - 1)) for i in range(k)}


# --------------------------------------------------------------------------- measurements file


def measurements_path(results_dir: str | Path, hardware: Hardware) -> Path:
    """One file per hardware + engine (+ CPU: measurements of one CPU never stand in for another's)."""
    cpu = f"__{hardware.cpu}" if hardware.cpu else ""
    return model_dir(results_dir) / "measurements" / f"{hardware.name}__{hardware.engine}{cpu}.parquet"


def load_measurements(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path) if path.exists() else pd.DataFrame()


# what a measurement row must share with a workload to stand for it: its name alone would let a changed prompt
# length or KV dtype reuse rows measured under the old one
WORKLOAD_KEY = ("workload", "prompt_len", "output_len", "concurrency", "dtype", "kv_dtype")


def _workload_key(wl: Workload) -> tuple[Any, ...]:
    return (wl.name, wl.prompt_len, wl.output_len, wl.concurrency, wl.dtype, wl.kv_dtype)


def _table_keys(table: pd.DataFrame) -> list[tuple[Any, ...]]:
    """Each row's workload key; rows from before kv_dtype was recorded were measured with the cache in the model's
    dtype (vLLM was not told otherwise), i.e. kv_dtype None."""
    kv = table["kv_dtype"] if "kv_dtype" in table else pd.Series(None, index=table.index, dtype=object)
    kv = kv.astype(object).where(kv.notna(), None)
    columns = [table[c] for c in WORKLOAD_KEY[:-1]]
    return [(str(n), int(p), int(o), int(c), str(d), k) for n, p, o, c, d, k in zip(*columns, kv, strict=True)]


def _matching(table: pd.DataFrame, workloads: Iterable[Workload]) -> pd.Series:
    """Rows measured under one of `workloads` (name, lengths, concurrency, dtype and KV dtype alike)."""
    keys = {_workload_key(w) for w in workloads}
    return pd.Series([k in keys for k in _table_keys(table)], index=table.index, dtype=bool)


def _done(table: pd.DataFrame) -> set[tuple[str, tuple[Any, ...]]]:
    if table.empty:
        return set()
    return set(zip(table["arch_id"], _table_keys(table), strict=True))


def _design_row(arch: Architecture, role: str, wl: Workload, spec: RunSpec) -> dict[str, Any]:
    """The columns every row of a measurements or estimates file carries: which architecture, workload, hardware, model."""
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
        "kv_dtype": wl.kv_dtype,
        "hardware": spec.scenario.hardware.name,
        "model": spec.model.name,
    }


def _row_meta(arch: Architecture, role: str, wl: Workload, spec: RunSpec, settings: EngineSettings) -> dict[str, Any]:
    return {
        **_design_row(arch, role, wl, spec),
        "cpu": spec.scenario.hardware.cpu,
        "engine": settings.engine,
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
    done = _done(table)
    todo = [(a, r) for a, r in plan if any((arch_id(a), _workload_key(w)) not in done for w in workloads)]
    log(f"profiling {len(todo)} of {len(plan)} architectures ({len(plan) - len(todo)} already measured) on {[w.name for w in workloads]}")
    init_ray(spec.sweep.ray_address)
    roles, by_name, start = dict(todo), {w.name: w for w in workloads}, time.time()
    for n, (arch, rows) in enumerate(measure_many([a for a, _ in todo], base_config, workloads, settings), 1):
        new = pd.DataFrame([{**_row_meta(arch, roles[arch], by_name[r["workload"]], spec, settings), **r} for r in rows])
        if not table.empty:  # a re-measured architecture replaces its earlier rows of these workloads
            table = table[~((table["arch_id"] == arch_id(arch)) & _matching(table, workloads))]
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


def _rows(table: pd.DataFrame, role: str, workloads: dict[str, Workload]) -> pd.DataFrame:
    return table[(table["status"] == "ok") & (table["role"] == role) & _matching(table, workloads.values())]


def to_measurements(table: pd.DataFrame, role: str, workloads: dict[str, Workload]) -> list[Measurement]:
    """The rows of `role` as measurements. A GPU engine's KV cache is pinned to the workload's demand
    (cost/engine.py), so its capacity is the pin, not a measurement of the model's capacity term: left out (NaN)."""
    ok = _rows(table, role, workloads)
    out = []
    for r in ok.itertuples():
        values = {k: float(getattr(r, k)) for k in MEASURED}
        if pd.notna(getattr(r, "kv_pinned_gib", None)):
            values["kv_capacity_tokens"] = float("nan")
        out.append(Measurement(Architecture.from_json(r.architecture), workloads[r.workload], values))
    return out


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
    ok = table[(table["status"] == "ok") & _matching(table, workloads)]
    memory = runtime_memory(ok)
    if memory and settings.engine == "vllm-cpu":  # the CPU engine's runtime baseline replaces the hardware file's guess
        # (not on a GPU: there the rest of the device footprint holds the activations the model's workspace term
        # already counts, and that split has not been checked on a GPU, so the hardware file's value stays)
        params["memory_overhead_gib"] = memory["runtime_gib"]["median"]
    fitted_hw = dataclasses.replace(hw, **params)  # type: ignore[arg-type]
    record = {
        "hardware": hw.name,
        "cpu": hw.cpu,
        "cpu_identity": identity() if hw.cpu else None,
        "engine": settings.engine,
        "engine_version": str(ok["engine_version"].iloc[0]) if "engine_version" in ok else None,
        "dtype": settings.dtype,
        "kv_dtype": settings.kv_dtype,
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
        # bootstrap over each row's timed waves: how far a median moves, and how far the held-out MAPE moves with it
        "median_noise": median_noise_summary(ok),
        "validation_noise": mape_interval(predictions(space, fitted_hw, hold), _rows(table, "holdout", by_name)),
        "profiling_minutes": profiling_minutes(ok),
        "memory": memory,
        "measurements": str(measurements_path(spec.results_dir, spec.scenario.hardware)),
    }
    path = save_record(record, spec.results_dir)
    print_validation(record)
    print(f"\ncost model: {path}")
    return path


def runtime_memory(ok: pd.DataFrame) -> dict[str, dict[str, float]]:
    """CPU engines: the peak RSS split (cost/engine.memory_split), per architecture; each part's median, min and max (GiB)."""
    parts = [c for c in ("runtime_gib", "weights_gib", "kv_alloc_gib", "peak_gib") if c in ok]
    if "runtime_gib" not in parts or ok["runtime_gib"].isna().all():
        return {}
    per_arch = ok.groupby("arch_id")[parts].max()  # one engine start per architecture: its workloads share the peak
    return {c: {"median": float(per_arch[c].median()), "min": float(per_arch[c].min()), "max": float(per_arch[c].max())} for c in parts}


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
    if "noise" in record:  # engine measurements (estimates have neither noise nor profiling time)
        noise = ", ".join(f"{k} {100 * v:.1f}%" for k, v in record["noise"].items())
        print(f"run-to-run spread (median of (max-min)/median over repeats): {noise}")
    for key, v in record.get("median_noise", {}).items():
        interval = record.get("validation_noise", {}).get(key)
        moved = f"; held-out MAPE {interval[0]:.1f}-{interval[1]:.1f} % over those draws" if interval else ""
        print(
            f"noise of a median ({key}, 90 % bootstrap over {v['waves']} waves): median +-{100 * v['median']:.1f} %, "
            f"largest +-{100 * v['max']:.1f} %{moved}"
        )
    if record.get("memory"):
        mem = record["memory"]
        span = ", ".join(f"{k.removesuffix('_gib')} {v['min']:.2f}-{v['max']:.2f}" for k, v in mem.items() if k != "runtime_gib")
        runtime = mem["runtime_gib"]
        print(
            f"memory (peak RSS on a CPU, the device footprint on a GPU) = weights + KV cache + the rest; "
            f"its median {runtime['median']:.2f} GiB ({runtime['min']:.2f}-{runtime['max']:.2f} over architectures whose {span} GiB)"
        )
    if "profiling_minutes" in record:
        minutes = record["profiling_minutes"]
        per, total, n = minutes["per_architecture_median"], minutes["total"], minutes["architectures"]
        print(f"profiling: {per:.1f} min per architecture, {total:.0f} min for {n} architectures")


# --------------------------------------------------------------------------- aiconfigurator source

AIC_FIXED = ("step_overhead_ms", "prefill_overhead_ms")  # static-mode estimates have no per-step engine overhead
AIC_ROBUST = 0.1  # Cauchy loss past ~10 % log error: e.g. the RTX PRO 6000's table gives MHA decode at 16K context 6x GQA's


def aic_measurements_path(results_dir: str | Path, hardware: Hardware) -> Path:
    """Kernel-table estimates live apart from engine measurements: one never stands in for the other."""
    return model_dir(results_dir) / "measurements" / f"{hardware.name}__{hardware.engine}__aiconfigurator.parquet"


def wave_batch(space: SearchSpace, hw: Hardware, wl: Workload, arch: Architecture) -> int:
    """Sequences one wave decodes together: the workload's concurrency, or what the KV cache holds (0: not one)."""
    from autocompress.cost.analytic import AnalyticCostModel

    capacity = AnalyticCostModel(space, hw, wl).predict(arch)["kv_capacity_tokens"]
    return int(min(wl.concurrency, capacity // (wl.prompt_len + wl.output_len)))


def estimate_design(spec: RunSpec, space: SearchSpace, plan: list[tuple[Architecture, str]], workloads: list[Workload]) -> pd.DataFrame:
    """aiconfigurator's estimate of every (architecture, workload), plus the hardware file's per-step overheads.

    Static mode prefills a batch in one pass and decodes it without scheduler/sampler time, so the
    targets add the prior step overhead to TPOT and the prior per-chunk overhead to TTFT; those two
    terms stay fixed in the fit (AIC_FIXED). The raw estimates are kept (aic_* columns).
    """
    from autocompress.cost.aic import Estimator

    hw = spec.scenario.hardware
    assert hw.aiconfigurator is not None
    est, rows, start = Estimator(hw.aiconfigurator), [], time.time()
    for arch, role in tqdm(plan, desc=f"aiconfigurator {hw.aiconfigurator}", unit="arch", file=sys.stderr):
        for wl in workloads:
            row = {**_design_row(arch, role, wl, spec), "engine": hw.engine, "source": est.source}
            batch = wave_batch(space, hw, wl, arch)
            if batch < 1:
                rows.append({**row, "status": "failed", "error": "the KV cache cannot hold one sequence"})
                continue
            served = est.served(arch, wl, batch, hw)
            rows.append({**row, "status": "ok", "error": "", "batch": batch, **served, "kv_capacity_tokens": float("nan")})
    table = pd.DataFrame(rows)
    path = aic_measurements_path(spec.results_dir, hw)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet(table, path)
    interpolated = f"; KV-head counts interpolated between table entries: {sorted(est.interpolated_kv)}" if est.interpolated_kv else ""
    log(f"{len(table)} estimates from {est.source} in {time.time() - start:.0f}s -> {path}{interpolated}")
    return table


def fit_aiconfigurator(spec: RunSpec, space: SearchSpace, table: pd.DataFrame, workloads: list[Workload]) -> Path:
    """Fit the analytic terms to the estimates (on the system's own peaks), validate on the held-out ones, save.

    A derived card (hardware.aiconfigurator_derived) keeps the fitted efficiencies and overheads
    with its own datasheet peaks: that transfer is an assumption, flagged in the record and the id.
    """
    from autocompress.cost.aic import source_label, system_peaks

    hw = spec.scenario.hardware
    assert hw.aiconfigurator is not None
    own = dataclasses.replace(hw, **system_peaks(hw.aiconfigurator)) if hw.aiconfigurator_derived else hw  # type: ignore[arg-type]
    by_name = {w.name: w for w in workloads}
    fit_data, hold = to_measurements(table, "fit", by_name), to_measurements(table, "holdout", by_name)
    if len(fit_data) < 3:
        raise ConfigError(f"only {len(fit_data)} architectures fit in {hw.name}'s memory; at least 3 are needed")
    params = fit_parameters(space, own, fit_data, fixed=AIC_FIXED, robust=AIC_ROBUST)
    fitted = dataclasses.replace(own, **params)  # type: ignore[arg-type]
    # each workload also gets terms of its own (batch 1 vs 256, 1K vs 16K prompts): auto uses them for that workload
    by_workload, validation_by_workload, predicted = {}, {}, []
    for wl in workloads:
        fit_w, hold_w = [m for m in fit_data if m.workload == wl], [m for m in hold if m.workload == wl]
        if len(fit_w) < 3:
            continue
        own_w = dataclasses.replace(own, **fit_parameters(space, own, fit_w, fixed=AIC_FIXED, robust=AIC_ROBUST))  # type: ignore[arg-type]
        by_workload[wl.name] = {
            **{k: getattr(own_w, k) for k in FITTED},
            "peak_tflops": hw.peak_tflops,
            "mem_bandwidth_gbs": hw.mem_bandwidth_gbs,
        }
        validation_by_workload[wl.name] = validate(space, own_w, hold_w)
        predicted += [(own_w, m) for m in hold_w]
    record = {
        "hardware": hw.name,
        "engine": hw.engine,
        "engine_version": None,
        "source_kind": "aiconfigurator",
        "source": source_label(hw.aiconfigurator),
        "derived_from": hw.aiconfigurator if hw.aiconfigurator_derived else None,
        "note": "fitted to aiconfigurator-core's static-mode estimates from kernel tables measured in vLLM 0.24.0, plus the "
        "hardware file's per-step overheads (held fixed): evidence from measured kernels, not an end-to-end serving measurement"
        + (
            f"; efficiencies fitted on {hw.aiconfigurator}'s peaks and carried over to {hw.name}'s datasheet peaks"
            if hw.aiconfigurator_derived
            else ""
        ),
        "dtype": workloads[0].dtype,
        "model": spec.model.name,
        "workloads": [dataclasses.asdict(w) for w in workloads],
        "parameters": {**params, "peak_tflops": hw.peak_tflops, "mem_bandwidth_gbs": hw.mem_bandwidth_gbs},
        "fixed": list(AIC_FIXED),
        "ranges": ranges(fit_data + hold),
        "n_fit": len(fit_data),
        "n_holdout": len(hold),
        "by_workload": by_workload,
        "validation": validate_each(space, predicted) if predicted else validate(space, fitted, hold),
        "validation_by_workload": validation_by_workload,
        "validation_one_set": validate(space, fitted, hold),
        "validation_analytic": validate(space, own, hold),
        "validation_of": hw.aiconfigurator,
        "measurements": str(aic_measurements_path(spec.results_dir, hw)),
    }
    path = save_record(record, spec.results_dir)
    print_validation(record)
    for name, v in validation_by_workload.items():
        print(f"  {name}: " + ", ".join(f"{k} MAPE {m['mape']:.2f}% Spearman {m['spearman']:.3f}" for k, m in v.items()))
    print(f"\ncost model: {path} ({record['source']}{', derived' if hw.aiconfigurator_derived else ''})")
    return path
