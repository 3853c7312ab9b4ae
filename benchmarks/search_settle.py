"""Issue 15 item 7: does settling (search.settle_steps) beat repair where the search's argmax misses a bound?

Runs the search_quality settings whose rtx5070_coding argmax was infeasible (margin 0.1 / seed 0 and
margin 0 / seed 1, dual step 0.5) with `search.settle_steps=N`, and records the argmax after
settling, after repair and after fill (report- and selection-split KL, parameters, feasibility).
Compare with benchmarks/results/search_ablation.json (the same searches without settling).
Writes benchmarks/results/search_settle_<scenario>.json.

    .venv/bin/python benchmarks/search_settle.py --scenario rtx5070_coding --settle 32 \
        data.source=jsonl data.path=../shared/data/corpora/c4_sample
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from autocompress.arch.masking import MaskedModel
from autocompress.config.compose import compose_spec
from autocompress.config.cpuinfo import identity as cpu
from autocompress.config.schema import LagrangianSettings
from autocompress.cost.base import meets
from autocompress.search.differentiable import evaluate, run_search
from autocompress.search.prepare import prepare

SETTINGS = [LagrangianSettings(margin=0.1, dual_lr=0.5), LagrangianSettings(margin=0.0, dual_lr=0.5, seed=1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--settle", type=int, default=32, help="search.settle_steps")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--note", default="", help="what else shared the machine")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = compose_spec(f"+scenario={args.scenario}", *args.overrides)
    p = prepare(spec, progress=False)
    model, inputs, cm, space = p.base.model, p.inputs, p.cost_model, p.space
    rows: list[dict[str, Any]] = []
    for settings in SETTINGS:
        start = time.time()
        res = run_search(model, inputs, cm, dataclasses.replace(spec.search, settle_steps=args.settle), settings)
        masked = MaskedModel(model, space, inputs.ranking)
        row: dict[str, Any] = {"settings": dataclasses.asdict(settings), "settle_steps": res.settle_steps}
        row |= {"repair_steps": res.repair_steps, "fill_steps": res.fill_steps}
        for key, arch in (("argmax", res.argmax), ("repaired", res.repaired), ("final", res.architecture)):
            assert arch is not None
            kl, _ = evaluate(model, masked, arch, inputs.report, inputs.teacher_report)
            kl_select, _ = evaluate(model, masked, arch, inputs.select, inputs.teacher_select)
            row[key] = {"kl": kl, "kl_select": kl_select, "params": arch.num_params(), "feasible": meets(cm, inputs.constraints, arch)}
        masked.remove()
        row["wall_s"] = time.time() - start
        rows.append(row)
        print(json.dumps(row), flush=True)
    command = f"benchmarks/search_settle.py --scenario {args.scenario} --settle {args.settle} " + " ".join(args.overrides)
    run = {"command": command, "cpu": {**cpu(), "shared_with": args.note}}
    out = {"scenario": args.scenario, "settle": args.settle, "runs": rows, "_run": run}
    path = Path(f"benchmarks/results/search_settle_{args.scenario}.json")
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
