"""Where `make demo`'s time goes (issue 44 item 6): runs the demo's sweep (the Makefile's SCENARIO and DEMO_ARGS) as a
fresh clone would, with an empty model cache (the embedded checkpoint is converted again, the CPU peaks measured
again), and splits its wall time by stage from what the run records: the command's start (imports, Hydra, checks),
prepare()'s stages (metadata.json `prepare_seconds`), the trials' phases (trials.parquet `<phase>_s`) and what Ray
Tune adds around them. The install is not run here (see benchmarks/results/ci_timing.json and the README).

    .venv/bin/python benchmarks/demo_breakdown.py                  # run the demo's sweep, then break it down
    .venv/bin/python benchmarks/demo_breakdown.py --run RUN_DIR    # break down a run made with the demo's command

Writes benchmarks/results/demo_breakdown.json (with the commit, the CPU and whether the machine was shared)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # checks that the autocompress imported is this tree's
import pandas as pd

from autocompress.io import RunPaths
from autocompress.search.differentiable import SEARCH_PHASES

ROOT = Path(__file__).resolve().parents[1]


def demo_command() -> list[str]:
    """The sweep `make demo` runs: its SCENARIO and DEMO_ARGS, read from the Makefile."""
    text = (ROOT / "Makefile").read_text()
    scenario = re.search(r"^SCENARIO \?= (\S+)", text, re.M)
    args = re.search(r"^DEMO_ARGS \?= (.*)$", text, re.M)
    if scenario is None or args is None:
        raise SystemExit("error: the Makefile has no SCENARIO ?= / DEMO_ARGS ?= line; this script reads the demo from them")
    return [f"+scenario={scenario.group(1)}", *args.group(1).split()]


def run_demo(results: Path) -> tuple[Path, float]:
    """The demo's sweep into `results` with an empty cache; (its run folder, the command's wall seconds)."""
    run_id = dt.datetime.now().strftime("demo-%Y%m%d-%H%M%S")
    cmd = [sys.executable, "-m", "autocompress.sweep", *demo_command(), f"results.dir={results}", f"results.run_id={run_id}"]
    with tempfile.TemporaryDirectory(prefix="autocompress-cache-") as cache:
        env = {**os.environ, "AUTOCOMPRESS_CACHE": cache}  # as on a fresh machine: conversion and CPU peaks included
        start = time.time()
        done = subprocess.run(cmd, env=env, cwd=ROOT)
        wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"error: the demo's sweep exited {done.returncode}")
    return results / demo_command()[0].split("=", 1)[1] / run_id, wall


def breakdown(run: Path, wall: float | None) -> dict[str, Any]:
    files = RunPaths(run)
    meta = json.loads(files.metadata_file.read_text())
    trials = pd.read_parquet(files.trials_file)
    ok = trials[trials["status"] == "ok"]
    prepare = {k: round(v, 1) for k, v in (meta.get("prepare_seconds") or {}).items()}
    sweep = float(meta.get("sweep_wall_s", float("nan")))
    phases = {p: round(float(ok[f"{p}_s"].sum()), 1) for p in SEARCH_PHASES if f"{p}_s" in ok}
    trial_sum = float(ok["wall_s"].sum())
    out: dict[str, Any] = {
        "command": "python -m autocompress.sweep " + " ".join(demo_command()),
        "run": str(run),
        "trials": len(ok),
        "wall_s": None if wall is None else round(wall, 1),
        "prepare_s": prepare,
        "sweep_s": round(sweep, 1),  # the trials on Ray Tune, from the first trial's start to the last one's end
        "trial_phases_s": phases,  # summed over the trials (they run side by side: this is CPU time of one core each)
        "trial_wall_s": {
            "sum": round(trial_sum, 1),
            "min": round(float(ok["wall_s"].min()), 1),
            "max": round(float(ok["wall_s"].max()), 1),
        },
        "searcher": (meta.get("sweep_definition") or {}).get("searcher"),
    }
    if wall is not None:
        out["start_s"] = round(wall - sum(prepare.values()) - sweep, 1)  # imports, Hydra, checks, Ray's start, writing
    return out


def markdown(b: dict[str, Any]) -> str:
    rows = [("whole command", b.get("wall_s"))] if b.get("wall_s") is not None else []
    rows += [("start (imports, Hydra, checks, Ray)", b.get("start_s"))] if "start_s" in b else []
    rows += [(f"prepare: {k}", v) for k, v in b["prepare_s"].items()]
    rows += [("trials on Ray Tune (wall)", b["sweep_s"])]
    rows += [(f"  summed over {b['trials']} trials: {k}", v) for k, v in b["trial_phases_s"].items()]
    lines = ["| stage | seconds |", "| --- | ---: |"] + [f"| {k} | {v:.0f} |" for k, v in rows if v is not None]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a run folder made with the demo's command (default: run the demo now)")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "out" / "demo", help="where the demo's run goes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "demo_breakdown.json")
    parser.add_argument("--shared", default=None, help="what else ran on the machine meanwhile (recorded beside the measured share)")
    args = parser.parse_args()
    record = common.Record(args.shared)
    run, wall = (args.run, None) if args.run else run_demo(args.results_dir.resolve())
    result = breakdown(run, wall)
    result["_record"] = record.as_dict()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    print(f"\n{args.out}")


if __name__ == "__main__":
    main()
