"""Minitron's pick at given (width, depth) limit pairs, each pair alone: how much the limits decide.

compare's Minitron widens ModelOpt's limits (0.4 width, 0.2 depth) a level at a time when they admit
nothing and lets the selection-split score choose among the pairs of the first level where one admits
10 candidates. This scores Minitron's own procedure (importance, the top 10 feasible candidates by
parameters, the lowest selection-split KL) at each pair given, with no widening, and reports each
pick's report-split KL: a pair off compare's level that gives a clearly better model would mean the
rule still handicaps the baseline.

    .venv/bin/python benchmarks/minitron_limits.py --run results/rtx5080_game/issue15 \
        --limits 0.4,0.4 --limits 0.4,0.5 --limits 0.5,0.5 data.source=jsonl data.path=../shared/data/corpora/c4_sample
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import common  # checks that the autocompress imported is this tree's

from autocompress.arch.importance import teacher_hidden
from autocompress.arch.masking import MaskedModel
from autocompress.baselines import minitron
from autocompress.baselines.comparison import job_from_dict
from autocompress.baselines.context import build_context
from autocompress.config.compose import compose_dict
from autocompress.errors import InfeasibleError
from autocompress.results.store import load_run
from autocompress.search.differentiable import evaluate

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a finished sweep run folder")
    parser.add_argument("--limits", action="append", required=True, metavar="WIDTH,DEPTH")
    parser.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/minitron_limits_<scenario>.json)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (data.source=jsonl data.path=...)")
    args = parser.parse_args()
    record = common.Record()
    run_dir = Path(args.run).resolve()
    scenario = load_run(run_dir).spec.scenario.name  # type: ignore[union-attr]
    job = job_from_dict(compose_dict(f"+scenario={scenario}", f"compare.run={run_dir}", *args.overrides))
    ctx = build_context(job, run_dir)
    model, space = ctx.model, ctx.space
    select = ctx.data.select
    teacher_select = teacher_hidden(model, select, desc="teacher (selection)")
    teacher_report = teacher_hidden(model, ctx.data.report, desc="teacher (report)")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"minitron_limits_{scenario}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []

    def save() -> None:  # after every pair: a stopped run keeps what it measured
        result = {"scenario": scenario, "run": str(run_dir), "overrides": args.overrides, "picks": rows, "_record": record.as_dict()}
        out.write_text(json.dumps(result, indent=2) + "\n")

    for pair in args.limits:
        width, depth = (float(x) for x in pair.split(","))
        mspec = dataclasses.replace(job.compare.minitron, max_width_pruning=width, max_depth_pruning=depth, widen=False)
        start = time.time()
        try:
            res = minitron.search(model, space, ctx.cost_model, ctx.constraints, ctx.data.calib, select, teacher_select, mspec)
        except InfeasibleError:
            rows.append({"max_width_pruning": width, "max_depth_pruning": depth, "feasible": 0})
            save()
            continue
        masked = MaskedModel(model, space, res.ranking)
        kl_report, ppl_report = evaluate(model, masked, res.best.arch, ctx.data.report, teacher_report)
        masked.remove()
        b = res.best
        rows.append(
            {
                "max_width_pruning": width,
                "max_depth_pruning": depth,
                "feasible": res.feasible,
                "scored": len(res.scored),
                "hidden": b.hidden,
                "num_attention_heads": b.heads,
                "kv_heads": b.kv_heads,
                "ffn": b.ffn,
                "layers_kept": space.num_layers - len(b.dropped),
                "params": b.params,
                "kl_select": float(res.scored["kl"].min()),
                "kl_report": kl_report,
                "perplexity_report": ppl_report,
                "seconds": time.time() - start,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        save()
    print(f"-> {out}")


if __name__ == "__main__":
    main()
