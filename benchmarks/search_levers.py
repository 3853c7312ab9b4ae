"""Issue 15 item 7: which lever of the search itself moves report-split KL at the same bounds?

Runs the default grid's four searches at the bounds (margin 0; dual steps 0.5 and 2.0; seeds 0 and 1)
once per lever, each lever a set of Hydra overrides on top of the scenario (search budget, temperature
schedule, importance estimate, calibration size). The homogeneous rival is off: every row is the
search's own result (repaired and filled), which is what a lever can change. Levers that change the
text or the importance ranking prepare again; the others share one preparation.
Writes benchmarks/results/search_levers_<scenario>.json (selection- and report-split KL, parameters,
repair / fill steps and seconds per search; the CPU and what else shared it).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/search_levers.py --scenario rtx5070_coding \
        --lever base= --lever steps96=search.steps=96 data.source=jsonl data.path=../shared/data/corpora/c4_sample
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autocompress.config.compose import compose_spec
from autocompress.config.cpuinfo import identity as cpu
from autocompress.config.schema import LagrangianSettings
from autocompress.cost.base import meets
from autocompress.search.differentiable import run_search
from autocompress.search.prepare import prepare

GRID = [LagrangianSettings(dual_lr=d, seed=s) for s in (0, 1) for d in (0.5, 2.0)]
SETTINGS_KEYS = {f.name for f in dataclasses.fields(LagrangianSettings)}
PREPARE_PREFIXES = ("data.", "search.importance_sequences", "model.", "cost_model")


def parse_lever(text: str) -> tuple[str, list[str]]:
    """NAME=OVERRIDE[,OVERRIDE...]: e.g. steps96=search.steps=96 or tau=tau_end=0.3 (a Lagrangian setting)."""
    name, _, rest = text.partition("=")
    if not name:
        raise SystemExit(f"--lever {text!r}: give NAME=OVERRIDES (e.g. steps96=search.steps=96), or NAME= for the defaults")
    return name, [o for o in rest.split(",") if o]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--lever", action="append", required=True, help="NAME=OVERRIDES, comma-separated; a bare key=value "
                        "whose key is a Lagrangian setting (tau_end, lr, ...) changes every search's settings")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--note", default="", help="what else shared the machine")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every lever")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_path = args.out or Path(f"benchmarks/results/search_levers_{args.scenario}.json")
    out: dict[str, Any] = {"scenario": args.scenario, "levers": {}}
    if out_path.exists():  # levers already measured are kept (a rerun adds the missing ones)
        out = json.loads(out_path.read_text())
    cache: dict[tuple[str, ...], Any] = {}
    for name, overrides in map(parse_lever, args.lever):
        if name in out["levers"]:
            print(f"{name}: already in {out_path}, kept", flush=True)
            continue
        settings_overrides = {k: type(getattr(LagrangianSettings(), k))(v) for k, _, v in (o.partition("=") for o in overrides) if k in SETTINGS_KEYS}
        hydra = [o for o in overrides if o.partition("=")[0] not in SETTINGS_KEYS]
        spec = compose_spec(f"+scenario={args.scenario}", "search.homogeneous_candidate=false", *args.overrides, *hydra)
        key = tuple(sorted(o for o in hydra if o.startswith(PREPARE_PREFIXES)))
        if key not in cache:
            cache.clear()  # one preparation in memory at a time
            start = time.time()
            cache[key] = prepare(spec, progress=False)
            print(f"{name}: prepared in {time.time() - start:.0f}s", flush=True)
        p = cache[key]
        rows: list[dict[str, Any]] = []
        for base in GRID:
            settings = dataclasses.replace(base, **settings_overrides)
            res = run_search(p.base.model, p.inputs, p.cost_model, spec.search, settings)
            row = {"settings": dataclasses.asdict(settings), "kl_select": res.kl_select, "kl_report": res.kl}
            row |= {"params": res.architecture.num_params(), "feasible": meets(p.cost_model, p.inputs.constraints, res.architecture)}
            row |= {"repair_steps": res.repair_steps, "fill_steps": res.fill_steps, "wall_s": round(res.wall_s, 1)}
            rows.append(row)
            print(f"{name}: {json.dumps(row)}", flush=True)
        best = min(rows, key=lambda r: r["kl_select"])
        out["levers"][name] = {
            "overrides": overrides,
            "searches": rows,
            "best": {k: best[k] for k in ("kl_select", "kl_report", "params", "settings")},
            "mean_kl_select": statistics.fmean(r["kl_select"] for r in rows),
            "mean_kl_report": statistics.fmean(r["kl_report"] for r in rows),
            "search_s": sum(r["wall_s"] for r in rows),
        }
        out["_run"] = {
            "command": "benchmarks/search_levers.py --scenario " + args.scenario + " " + " ".join(args.overrides),
            "cpu": {**cpu(), "threads": args.threads, "shared_with": args.note},
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(out_path)  # written after every lever: an interrupted run keeps what it measured


if __name__ == "__main__":
    main()
