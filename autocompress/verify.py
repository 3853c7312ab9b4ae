"""`python -m autocompress.verify results/<scenario>/<run>/pareto.parquet`: measure Pareto points in the real engine.

`... verify.source=aiconfigurator` instead estimates them from NVIDIA's kernel tables (GPU
scenarios on a machine without that GPU): `estimated_*` columns and `feasible_estimated`, never
written into the `measured_*` ones.

Each architecture runs in the serving engine on the run's workload, exactly as profiling measures
it (autocompress.cost.engine). The measured TTFT / TPOT / throughput / KV capacity / peak memory land
next to the predicted columns (`measured_<metric>`, with run-to-run spreads), with
`feasible_measured` (every constraint met by the measured medians) and
`feasible_within_noise` (met once each measurement may be off by its own spread). On a GPU the
engine's peak RSS is host memory, so the engine is given the KV cache the workload needs
(`kv_cache_memory_bytes`, not `gpu_memory_utilization` of the device) and `measured_memory_gib` is the
worker's device footprint by its own accounting (cost/vllm_worker.py); a GPU row without it leaves a memory
bound in `unverified_constraints` instead of judged from RSS (this path has not run on a GPU here). On a CPU the peak RSS is
also split into `measured_weights_gib`, `measured_kv_alloc_gib` (the KV cache the engine allocated)
and `measured_runtime_gib` (the rest: the runtime's baseline, the same for any architecture). The file is
written atomically; the sweep's pareto.parquet and trials.parquet are never rewritten (load_run merges by trial id).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd

from autocompress.arch.space import Architecture
from autocompress.cluster import init_ray
from autocompress.config.cliargs import guarded
from autocompress.config.metrics import TIMED, Constraint
from autocompress.config.schema import RunSpec
from autocompress.cost.engine import check_devices, measure_many, measured_metrics, measured_spreads, require_vllm, settings_for
from autocompress.errors import ConfigError
from autocompress.io import RunPaths, check_writable, log, write_parquet
from autocompress.model.base import load_base_model
from autocompress.results.runcheck import CheckedRun, check_run_folder
from autocompress.results.store import read_table


def _constraints(meta: dict[str, Any]) -> tuple[Constraint, ...]:
    """The run's absolute bounds (metadata.json, checked by `check_run_folder`)."""
    return tuple(Constraint(metric, float(c["value"])) for metric, c in meta["constraints"].items())


def measured_columns(rows: list[dict[str, Any]], constraints: tuple[Constraint, ...]) -> dict[str, Any]:
    """One Parquet row's measured columns from the engine's rows (one workload)."""
    (row,) = rows
    cols: dict[str, Any] = {"verify_status": row["status"], "verify_error": row.get("error", "")}
    if row["status"] != "ok":
        return cols | {"feasible_measured": False, "feasible_within_noise": False}
    cols |= {f"measured_{k}": v for k, v in measured_metrics(row).items()}
    cols |= {f"measured_{k}_spread": v for k, v in measured_spreads(row).items()}
    if row.get("cpu"):
        cols["measured_on_cpu"] = row["cpu"]  # CPUs of one kind differ several-fold
    # the footprint (peak RSS on a CPU, the device footprint on a GPU) split into weights, the KV cache the engine
    # allocated, and the rest
    cols |= {f"measured_{k}": row[k] for k in ("weights_gib", "kv_alloc_gib", "runtime_gib") if row.get(k) is not None}
    if row.get("memory_accounting_error"):  # why a GPU row has no memory verdict
        cols["verify_memory_error"] = row["memory_accounting_error"]
    strict, loose, unverified = True, True, []
    for c in constraints:
        if f"measured_{c.metric}" not in cols:  # memory on a GPU node without the engine's figure: never from RSS
            unverified.append(c.metric)
            continue
        value = cols[f"measured_{c.metric}"]
        spread = cols.get(f"measured_{c.metric}_spread", 0.0)
        strict &= c.satisfied(value)
        slack = value * (1 - spread) if c.sense == "max" else value * (1 + spread)
        loose &= c.satisfied(slack)
    return cols | {"feasible_measured": strict, "feasible_within_noise": loose, "unverified_constraints": ",".join(unverified)}


def _merge(frame: pd.DataFrame, measured: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """`frame` with the measured columns of the verified trial ids (others keep NaN / unchanged)."""
    extra = pd.DataFrame.from_dict(measured, orient="index")
    extra.index.name = "trial_id"
    keep = frame.drop(columns=[c for c in extra.columns if c in frame.columns])
    return keep.merge(extra, left_on="trial_id", right_index=True, how="left")


def _run_of(path: Path) -> tuple[Path, CheckedRun]:
    """(pareto file, its run folder checked) of a pareto.parquet or a run folder given on the command line."""
    if path.is_dir():
        path = RunPaths(path).pareto_file
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give results/<scenario>/<run_id>/pareto.parquet of a finished sweep")
    return path, check_run_folder(path.parent, status="any", tables=(path,), fronts=False)


def _spec(run: CheckedRun) -> RunSpec:
    assert run.spec is not None  # check_run_folder's config="required"
    return run.spec


def _finished(path: Path, what: str) -> pd.DataFrame:
    table = read_table(path)
    table = table[table["status"] == "ok"] if "status" in table else table
    if table.empty:
        raise ConfigError(f"{path} has no finished trials to {what}")
    return table


def _check_rows(target: Path, trials: pd.Series, overwrite: bool) -> None:
    """Before any measurement: rows of these trials already in verify's table are refused unless `overwrite`."""
    if overwrite or not target.exists():
        return
    done = sorted(set(read_table(target)["trial_id"].astype(str)) & set(trials.astype(str)))
    if done:
        shown = ", ".join(done[:3]) + (f" and {len(done) - 3} more" if len(done) > 3 else "")
        raise ConfigError(f"{target} already holds rows of {shown}; choose another out=DIR, or add overwrite=true to replace them")


def _save(found: dict[str, dict[str, Any]], out: Path, name: str) -> Path:
    """verify's own table (trial_id + its columns) in `out`, earlier rows of other trials kept; never the sweep's tables."""
    frame = pd.DataFrame.from_dict(found, orient="index").rename_axis("trial_id").reset_index()
    target = out / name
    if target.exists():
        old = pd.read_parquet(target)
        frame = pd.concat([old[~old["trial_id"].isin(frame["trial_id"])], frame], ignore_index=True)
    out.mkdir(parents=True, exist_ok=True)
    write_parquet(frame, target)
    return target


def verify(path: Path, out: Path | None = None, overwrite: bool = False) -> pd.DataFrame:
    """Measure every architecture of a pareto.parquet (or any trials file of a run; a run folder: its pareto.parquet) in the
    engine; the measured columns go to `out`/measured.parquet (default <run>/verify/), which report and export read."""
    path, run = _run_of(path)
    spec = _spec(run)
    out = Path(out) if out is not None else run.verify_dir
    check_writable(out, "out")
    table = _finished(path, "verify")
    _check_rows(out / "measured.parquet", table["trial_id"], overwrite)
    hw, wl = spec.scenario.hardware, spec.scenario.workload
    require_vllm(hw.engine)
    settings = settings_for(spec.profile, hw, [wl])
    constraints = _constraints(run.metadata)
    init_ray(spec.sweep.ray_address)
    check_devices(settings)  # a GPU scenario on a cluster without a GPU: refused before the model loads
    base_config = load_base_model(spec.model).model.config.to_dict()
    trials_of: dict[Architecture, list[str]] = {}
    for tid, text in zip(table["trial_id"], table["architecture"], strict=True):
        trials_of.setdefault(Architecture.from_json(text), []).append(str(tid))
    log(f"verifying {len(trials_of)} architectures of {path} in {hw.engine} on {wl.name}")
    measured: dict[str, dict[str, Any]] = {}
    for n, (arch, rows) in enumerate(measure_many(list(trials_of), base_config, [wl], settings), 1):
        cols = measured_columns(rows, constraints)
        measured.update({tid: cols for tid in trials_of[arch]})
        log(f"[{n}/{len(trials_of)}] {', '.join(trials_of[arch])}: {_line(cols)}")
    saved = _save(measured, out, "measured.parquet")
    result = _merge(table, measured)
    print_table(result)
    print(f"\nmeasured: {saved} (the sweep's tables are unchanged; report and export read it)")
    return result


def estimate(path: Path, out: Path | None = None, overwrite: bool = False) -> pd.DataFrame:
    """aiconfigurator's estimate of every architecture of a GPU run's pareto.parquet (plus the hardware file's per-step
    overheads), written to `out`/estimated.parquet (default <run>/verify/)."""
    from autocompress.arch.space import SearchSpace
    from autocompress.cost.aic import Estimator
    from autocompress.cost.design import wave_batch

    path, run = _run_of(path)
    spec = _spec(run)
    out = Path(out) if out is not None else run.verify_dir
    check_writable(out, "out")
    hw, wl = spec.scenario.hardware, spec.scenario.workload
    if not hw.aiconfigurator or hw.aiconfigurator_derived:
        why = f"its tables are another GPU's ({hw.aiconfigurator})" if hw.aiconfigurator else "it names no aiconfigurator system"
        raise ConfigError(f"verify.source=aiconfigurator cannot judge {hw.name}: {why}; verify there in the engine")
    table = _finished(path, "estimate")
    _check_rows(out / "estimated.parquet", table["trial_id"], overwrite)
    constraints = _constraints(run.metadata)
    est = Estimator(hw.aiconfigurator)  # names its missing package before any model is loaded
    base = Architecture.from_llama_config(load_base_model(spec.model).model.config)
    space = SearchSpace.from_base(base, spec.search.space)
    relative = {c.metric: c for c in spec.scenario.constraints if c.relative}
    if relative:  # "1.5x base" under aiconfigurator means 1.5x aiconfigurator's estimate of the base model
        base_est = est.served(base, wl, wave_batch(space, hw, wl, base), hw)
        swept = {c.metric: c.value for c in constraints}
        resolvable = {m: c for m, c in relative.items() if m in base_est}
        constraints = tuple(resolvable[c.metric].resolve(base_est) if c.metric in resolvable else c for c in constraints)
        moved = [f"{c.describe()} (the sweep's cost model: {swept[c.metric]:.4g})" for c in constraints if c.metric in resolvable]
        log("relative bounds against aiconfigurator's estimate of the base model: " + "; ".join(moved))
    found: dict[str, dict[str, Any]] = {}
    for tid, text in zip(table["trial_id"], table["architecture"], strict=True):
        arch = Architecture.from_json(text)
        batch = wave_batch(space, hw, wl, arch)
        cols: dict[str, Any] = {"estimated_source": f"{est.source} + {hw.name}'s per-step overheads"}
        if batch < 1:
            found[str(tid)] = cols | {"feasible_estimated": False}
            continue
        served = est.served(arch, wl, batch, hw)
        cols |= {f"estimated_{k}": served[k] for k in TIMED}
        judged = [c for c in constraints if f"estimated_{c.metric}" in cols]
        cols |= {f"estimated_bound_{c.metric}": c.value for c in judged}
        cols["feasible_estimated"] = all(c.satisfied(cols[f"estimated_{c.metric}"]) for c in judged)
        found[str(tid)] = cols
    saved = _save(found, out, "estimated.parquet")
    result = _merge(table, found)
    shown = ["trial_id"] + [c for m in TIMED for c in (m, f"estimated_{m}") if c in result]
    print(result[[*shown, "feasible", "feasible_estimated"]].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    unjudged = sorted({c.metric for c in constraints} - set(TIMED))
    note = f" (not estimated, judged by the cost model only: {', '.join(unjudged)})" if unjudged else ""
    print(f"\nfeasible under {est.source}: {int(result['feasible_estimated'].sum())}/{len(result)}{note}")
    print(f"estimated: {saved} (the sweep's tables are unchanged; report and export read it)")
    return result


def _line(cols: dict[str, Any]) -> str:
    if cols["verify_status"] != "ok":
        return "FAILED " + str(cols["verify_error"]).splitlines()[-1][:160]
    state = "feasible" if cols["feasible_measured"] else ("feasible within noise" if cols["feasible_within_noise"] else "INFEASIBLE")
    ttft, tpot, thr = cols["measured_ttft_ms"], cols["measured_tpot_ms"], cols["measured_throughput_tok_s"]
    unverified = f" (not verified: {cols['unverified_constraints']})" if cols.get("unverified_constraints") else ""
    return f"{state}: ttft {ttft:.0f}ms tpot {tpot:.1f}ms thr {thr:.0f}tok/s{unverified}"


def print_table(frame: pd.DataFrame) -> None:
    cols = ["trial_id"]
    for metric in TIMED:
        if f"measured_{metric}" in frame:
            cols += [metric, f"measured_{metric}"]
    cols += [c for c in ("feasible", "feasible_measured", "feasible_within_noise") if c in frame]
    print(frame[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if "feasible_measured" in frame:
        n, strict, loose = len(frame), int(frame["feasible_measured"].sum()), int(frame["feasible_within_noise"].sum())
        unverified = sorted({m for v in frame.get("unverified_constraints", pd.Series(dtype=str)).dropna() for m in str(v).split(",") if m})
        note = f" (judged without {', '.join(unverified)}: not measurable here)" if unverified else ""
        print(f"\nmeasured feasible: {strict}/{n}; within noise: {loose}/{n}{note}")


USAGE = (
    "usage: python -m autocompress.verify results/<scenario>/<run_id>[/pareto.parquet] [verify.source=engine|aiconfigurator] "
    "[out=DIR] [overwrite=true]\n  out=DIR  where verify writes measured.parquet / estimated.parquet (default: <run>/verify/); "
    "the sweep's tables are never rewritten\n  overwrite=true  replace rows of trials already in that table (refused otherwise)"
)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        sys.exit(0 if args[:1] in (["-h"], ["--help"]) else 2)
    pairs = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    unknown = [a for a in args[1:] if "=" not in a] + sorted(set(pairs) - {"verify.source", "out", "overwrite"})
    source = pairs.get("verify.source", "engine")
    if unknown or source not in ("engine", "aiconfigurator"):
        bad = unknown[0] if unknown else f"verify.source={source}"
        print(f"error: {bad!r} is not verify.source=engine|aiconfigurator, out=DIR or overwrite=true\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    if "out" in pairs and not pairs["out"].strip():
        print("error: out= is empty; give a folder or leave it out (default: <run>/verify/)", file=sys.stderr)
        sys.exit(2)
    if pairs.get("overwrite", "false").lower() not in ("true", "false"):
        print(f"error: overwrite={pairs['overwrite']}: expected true or false", file=sys.stderr)
        sys.exit(2)
    out = Path(pairs["out"]) if "out" in pairs else None
    overwrite = pairs.get("overwrite", "false").lower() == "true"
    code = guarded(lambda: (estimate if source == "aiconfigurator" else verify)(Path(args[0]), out, overwrite))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
