"""Ray Tune overhead: the same N searches of the tiny model through the sweep vs in a plain loop in one process.

Both sides prepare once (model, ranking, teacher outputs) and run the grid's first N settings one
after another with the same torch threads; the sweep adds Tune, its worker process and the
per-trial Parquet writes, and, cold, starting local Ray (overlapped with the teacher's outputs).
Warm, Ray is already up, as on a cluster the sweep joins. overhead = sweep_s / loop_s - 1; each
side runs --repeats times, interleaved, and the medians are compared.

.venv/bin/python benchmarks/tune_overhead.py --trials 8 --repeats 3 --out benchmarks/out/tune_overhead.json
.venv/bin/python benchmarks/tune_overhead.py --main-job --threads 2 --sides loop,cold --out benchmarks/out/tune_overhead_main.json

--main-job: the README's main job instead of the tiny model (SmolLM2-135M, +scenario=h100_batched, the default
steps, calibration text and grid), one trial at a time with --threads torch threads on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # checks that the autocompress imported is this tree's
import torch

from autocompress.config.compose import compose_spec
from autocompress.config.schema import RunSpec
from autocompress.io import RunPaths
from autocompress.model.base import load_base_model
from autocompress.search.differentiable import run_search
from autocompress.search.prepare import prepare
from autocompress.search.tune import grid_points, run_sweep, trial_row, trial_settings

TINY = [
    "+scenario=cpu_interactive",
    "model=tiny_llama",
    "search.space.hidden_divisor=16",
    "search.space.ffn_divisor=32",
    "search.importance_sequences=4",
    "data.seq_len=32",
    "data.calib_sequences=8",
    "data.select_sequences=4",
    "data.report_sequences=4",
    "scenario.constraints.tpot_ms=0.97x",
    "scenario.constraints.ttft_ms=0.9x",
]


def plain_loop(spec: RunSpec) -> tuple[float, float]:
    """(wall seconds, seconds inside the searches) of prepare + every trial in this process."""
    start = time.perf_counter()
    prepared = prepare(spec, progress=False)
    threads = int(spec.sweep.cpus_per_trial)  # as run_trial: the trial's CPUs are its torch threads
    torch.set_num_threads(threads)
    search = dataclasses.replace(spec.search, threads=threads)
    search_s = 0.0
    for point in grid_points(spec.sweep.definition["grid"], spec.sweep.num_trials, spec.search.settings.seed):
        settings = trial_settings(point, spec)
        model = load_base_model(spec.model).model
        result = run_search(model, prepared.inputs, prepared.cost_model, search, settings)
        trial_row(settings, result, prepared.inputs.constraints, prepared.cost_model)
        search_s += result.wall_s
    return time.perf_counter() - start, search_s


def through_sweep(spec: RunSpec, warm: bool) -> tuple[float, float]:
    """(wall seconds, seconds inside the searches) of the same trials through run_sweep on local Ray.

    Cold, the sweep starts Ray itself; warm, Ray is started first and not timed.
    """
    import pandas as pd
    import ray

    from autocompress.cluster import init_ray

    if warm:
        init_ray(None)
    start = time.perf_counter()
    run_dir = run_sweep(spec, "benchmark: no config.yaml\n")
    wall = time.perf_counter() - start
    ray.shutdown()
    return wall, float(pd.read_parquet(RunPaths(run_dir).trials_file)["wall_s"].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="search steps per trial (default: the search config's)")
    parser.add_argument("--main-job", action="store_true", help="SmolLM2 in h100_batched (the README's main job), not the tiny model")
    parser.add_argument("--sides", default="loop,cold,warm", help="which of loop, cold, warm to run (comma-separated)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per search (sweep.cpus_per_trial)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, interleaved; medians compared")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    load_before = os.getloadavg()
    args.record = common.Record()
    sides = [side for side in ("loop", "cold", "warm") if side in args.sides.split(",")]
    if "loop" not in sides:
        parser.error("--sides must include loop (the overhead is against it)")
    base = ["+scenario=h100_batched"] if args.main_job else TINY
    runs: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as results:
            overrides = [f"sweep.num_trials={args.trials}", f"sweep.cpus_per_trial={args.threads}"]
            overrides += [f"search.steps={args.steps}"] if args.steps else []
            overrides += ["sweep.max_concurrent_trials=1", f"results.dir={results}"]
            for side in sides:
                if side == "loop":
                    runs["loop"].append(plain_loop(compose_spec(*base, *overrides)))
                else:
                    spec = compose_spec(*base, *overrides, f"results.run_id={side}{repeat}")
                    runs[side].append(through_sweep(spec, warm=side == "warm"))
    wall = {side: statistics.median(w for w, _ in done) for side, done in runs.items()}
    report: dict[str, Any] = {
        "job": "main (SmolLM2-135M, h100_batched)" if args.main_job else "tiny",
        "trials": args.trials,
        "steps": args.steps or compose_spec(*base).search.steps,
        "threads": args.threads,
        "repeats": args.repeats,
        "loop_s": round(wall["loop"], 2),
    }
    for side in sides[1:]:
        report[f"sweep_{side}_s"] = round(wall[side], 2)
        report[f"overhead_{side}"] = round(wall[side] / wall["loop"] - 1, 4)
        report[f"overhead_{side}_per_trial_s"] = round((wall[side] - wall["loop"]) / args.trials, 3)
    report |= {
        "runs": {side: [{"wall_s": round(w, 2), "search_s": round(s, 2)} for w, s in done] for side, done in runs.items()},
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "_record": args.record.as_dict(),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
