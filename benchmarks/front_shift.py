"""How a GPU scenario's Pareto front moves when the analytic model gives way to the shipped fit (issue 14, item 7).

For each scenario: two sweeps at the default budgets, identical but for `cost_model` (`analytic`: the datasheet
roofline; `auto`: the fit to aiconfigurator's kernel tables shipped in autocompress/cost/fits/), then every point
of both fronts judged three ways: by the cost model that found it, by the other one, and by aiconfigurator-core's
own estimate (the evidence the fit was made from, not a GPU measurement). Reports per front: its points (params,
selection and report KL, predicted costs), how many of the analytic front's points the fit and aiconfigurator find
infeasible, and the best feasible point of each.

    .venv/bin/python benchmarks/front_shift.py --scenario h100_batched --c4
    .venv/bin/python benchmarks/front_shift.py --scenario h100_batched --run analytic=RUN_A --run auto=RUN_B
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common  # checks that the autocompress imported is this tree's

from autocompress.io import RunPaths

ROOT = Path(__file__).resolve().parents[1]
C4 = ROOT.parent / "shared" / "data" / "corpora" / "c4_sample"
MODELS = ("analytic", "auto")


def sweep(scenario: str, model: str, args: argparse.Namespace) -> tuple[Path, float]:
    """The run folder of the `model` sweep (run now unless it exists or --run gives it), and the seconds it took."""
    given = dict(r.split("=", 1) for r in args.run)
    if model in given:
        return Path(given[model]), 0.0
    run_id = f"{args.run_id}-{model}"
    run_dir = Path(args.results_dir) / scenario / run_id
    if RunPaths(run_dir).pareto_file.exists():
        return run_dir, 0.0
    data = ["data.source=jsonl", f"data.path={C4}"] if args.c4 else []
    cmd = [sys.executable, "-m", "autocompress.sweep", f"+scenario={scenario}", f"cost_model={model}"]
    cmd += [f"results.dir={args.results_dir}", f"results.run_id={run_id}", *data, *args.set]
    print("$", " ".join(cmd), flush=True)
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return run_dir, time.time() - start


def judge(run_dir: Path, results_dir: str) -> list[dict[str, Any]]:
    """Every point of a run's front under both cost models and aiconfigurator's estimate; each judge resolves a
    relative bound ("1.5x base") against its own figure for the base model."""
    from autocompress.arch.space import Architecture, SearchSpace
    from autocompress.config.compose import run_spec_of
    from autocompress.cost import get_cost_model
    from autocompress.cost.aic import Estimator
    from autocompress.cost.design import wave_batch
    from autocompress.model.base import load_base_model
    from autocompress.results.store import load_metadata, load_pareto

    spec = run_spec_of(run_dir)
    hw, wl = spec.scenario.hardware, spec.scenario.workload
    base = Architecture.from_llama_config(load_base_model(spec.model).model.config)
    space = SearchSpace.from_base(base, spec.search.space)
    judges: dict[str, Any] = {m: get_cost_model(space, spec.scenario, results_dir, m).predict for m in MODELS}
    if hw.aiconfigurator and not hw.aiconfigurator_derived:
        est = Estimator(hw.aiconfigurator)

        def served(arch: Architecture) -> dict[str, float]:
            batch = wave_batch(space, hw, wl, arch)
            return est.served(arch, wl, batch, hw) if batch >= 1 else {}

        judges["aiconfigurator"] = served
    bounds = {}
    for name, cost_of in judges.items():
        base_costs = cost_of(base)
        bounds[name] = tuple(c.resolve(base_costs) for c in spec.scenario.constraints if c.metric in base_costs)
    rows = []
    for _, r in load_pareto(run_dir).iterrows():
        arch = Architecture.from_json(r["architecture"])
        keys = ("trial_id", "origin", "architecture", "params", "kl_select", "kl", "margin", "dual_lr")
        row: dict[str, Any] = {k: r[k] for k in keys if k in r}
        for name, cost_of in judges.items():
            costs = cost_of(arch)
            row[f"{name}_costs"] = {c.metric: float(costs[c.metric]) for c in bounds[name] if c.metric in costs}
            row[f"feasible_{name}"] = bool(costs) and all(c.satisfied(costs[c.metric]) for c in bounds[name])
        rows.append(row)
    meta = load_metadata(run_dir)
    print(f"{run_dir}: {len(rows)} front points; cost model {meta.get('cost_model', {}).get('id')}", flush=True)
    return rows


def summary(fronts: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, rows in fronts.items():
        best = min(rows, key=lambda r: r["kl_select"]) if rows else None
        out[model] = {
            "points": len(rows),
            "distinct_architectures": len({r["architecture"] for r in rows}),
            "feasible_under": {m: sum(bool(r.get(f"feasible_{m}")) for r in rows) for m in (*MODELS, "aiconfigurator")},
            "best": None if best is None else {k: best[k] for k in ("trial_id", "origin", "params", "kl_select", "kl") if k in best},
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", required=True)
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--run-id", default="front-shift")
    parser.add_argument("--run", action="append", default=[], metavar="analytic|auto=RUN_DIR", help="a finished sweep to use")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for both sweeps")
    parser.add_argument("--c4", action="store_true", help=f"calibration, selection and report text from {C4}")
    parser.add_argument("--out", default="benchmarks/out/front_shift.json")
    args = parser.parse_args()
    record = common.Record()
    result: dict[str, Any] = {"command": " ".join(sys.argv), "scenarios": {}}
    for scenario in args.scenario:
        fronts, seconds, runs = {}, {}, {}
        for model in MODELS:
            run_dir, seconds[model] = sweep(scenario, model, args)
            runs[model] = str(run_dir)
            fronts[model] = judge(run_dir, args.results_dir)
        result["scenarios"][scenario] = {"runs": runs, "sweep_seconds": seconds, "summary": summary(fronts), "fronts": fronts}
        print(json.dumps(result["scenarios"][scenario]["summary"], indent=1), flush=True)
    result["_record"] = record.as_dict()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
