"""Issue 15 item 7: which lever of the search itself moves report-split KL at the same bounds?

Runs the grid's searches at the bounds (margin 0; each of the sweep grid's dual steps, by default 0.5 and 2.0; seeds 0 and 1)
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
import time
from pathlib import Path
from typing import Any

import common
import torch
from common import dual_steps

from autocompress.config.compose import compose_spec
from autocompress.config.schema import LagrangianSettings
from autocompress.io import write_json
from autocompress.search.differentiable import run_search
from autocompress.search.prepare import prepare

LEGACY_DUAL_STEPS = [0.5, 2.0]  # what files written before "dual_steps" was stored were searched at
SETTINGS_KEYS = {f.name for f in dataclasses.fields(LagrangianSettings)}
# Overrides that change only the search itself: levers that differ in nothing else share one preparation
# (text, teacher outputs, importance ranking, space, cost model and bounds); any other override prepares again.
SEARCH_ONLY = (
    "search.steps",
    "search.batch_size",
    "search.init_bias",
    "search.straight_through",
    "search.settle_steps",
    "search.settle_lr",
    "search.candidates",
    "search.fill",
    "search.threads",
    "search.probe_sequences",
    "search.settings.",
)


def parse_lever(text: str) -> tuple[str, list[str]]:
    """NAME=OVERRIDE[,OVERRIDE...] (no list values): e.g. steps96=search.steps=96; a bare Lagrangian setting
    (tau03=tau_end=0.3) means search.settings.tau_end=0.3."""
    name, _, rest = text.partition("=")
    if not name:
        raise SystemExit(f"--lever {text!r}: give NAME=OVERRIDES (e.g. steps96=search.steps=96), or NAME= for the defaults")
    overrides = [o for o in rest.split(",") if o]
    return name, [f"search.settings.{o}" if o.partition("=")[0] in SETTINGS_KEYS else o for o in overrides]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", required=True)
    parser.add_argument(
        "--lever",
        action="append",
        required=True,
        help="NAME=OVERRIDES, comma-separated; a bare key=value "
        "whose key is a Lagrangian setting (tau_end, lr, ...) sets search.settings.KEY",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--note", default="", help="what else shared the machine")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every lever")
    args = parser.parse_args()
    record = common.Record(args.note)
    torch.set_num_threads(args.threads)
    out_path = args.out or Path(f"benchmarks/results/search_levers_{args.scenario}.json")
    steps = dual_steps(compose_spec(f"+scenario={args.scenario}", *args.overrides).sweep.definition)
    out: dict[str, Any] = {"scenario": args.scenario, "common": args.overrides, "dual_steps": steps, "levers": {}}
    if out_path.exists():  # levers already measured are kept (a rerun adds the missing ones), never mixed with others
        out = json.loads(out_path.read_text())
        if out.get("scenario") != args.scenario or out.get("common") != args.overrides:
            raise SystemExit(f"{out_path} holds levers measured with other common overrides; give another --out")
        stored = out.setdefault("dual_steps", LEGACY_DUAL_STEPS)
        if stored != steps:
            raise SystemExit(f"{out_path} holds levers searched at dual steps {stored}, the sweep grid now has {steps}; give another --out")
    levers = list(map(parse_lever, args.lever))
    for name, overrides in levers:
        if name in out["levers"] and out["levers"][name]["overrides"] != overrides:
            raise SystemExit(
                f"{out_path} holds lever {name} with {out['levers'][name]['overrides']}; rename the lever or give another --out"
            )
    cache: dict[tuple[str, ...], Any] = {}
    for name, overrides in levers:
        if name in out["levers"]:
            print(f"{name}: already in {out_path}, kept", flush=True)
            continue
        every = [*args.overrides, *overrides]
        spec = compose_spec(f"+scenario={args.scenario}", "search.homogeneous_candidate=false", *every)
        if dual_steps(spec.sweep.definition) != steps:
            raise SystemExit(f"lever {name} changes the grid's dual steps; levers must share them to be compared")
        if spec.search.start != "base":
            raise SystemExit(f"lever {name}: search.start={spec.search.start} needs the rival, which this benchmark turns off")
        key = tuple(sorted(o for o in every if not o.lstrip("+").startswith(SEARCH_ONLY)))
        if key not in cache:
            cache.clear()  # one preparation in memory at a time
            start = time.time()
            cache[key] = prepare(spec, progress=False)
            print(f"{name}: prepared in {time.time() - start:.0f}s", flush=True)
        p = cache[key]
        base = spec.search.settings
        rows: list[dict[str, Any]] = []
        for settings in [dataclasses.replace(base, margin=0.0, dual_lr=d, seed=base.seed + s) for s in (0, 1) for d in steps]:
            res = run_search(p.base.model, p.inputs, p.cost_model, spec.search, settings)
            row = {"settings": dataclasses.asdict(settings), "kl_select": res.kl_select, "kl_report": res.kl}
            row |= {"params": res.architecture.num_params(), "feasible": all(res.feasible.values())}
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
            "threads": args.threads,
            "_record": record.as_dict(),
        }
        out["command"] = "benchmarks/search_levers.py --scenario " + args.scenario + " " + " ".join(args.overrides)
        write_json(out, out_path)  # after every lever: an interrupted run keeps what it measured


if __name__ == "__main__":
    main()
