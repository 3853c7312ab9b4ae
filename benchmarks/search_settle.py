"""Issue 15 item 7: does settling (search.settle_steps) beat repair where the search's argmax misses a bound?

Runs searches with `search.settle_steps=N` (and each `--settle-lr`, the step while settling as a fraction of
the search's lr) and records the argmax after settling, after repair and after fill (report- and
selection-split KL, parameters, feasibility). The default settings are the search_quality ones whose
rtx5070_coding argmax was infeasible at 24 steps (margin 0.1 / seed 0 and margin 0 / seed 1, dual step 0.5);
`--setting MARGIN:DUAL_STEP:SEED` picks others. The homogeneous rival keeps its default (set
search.homogeneous_candidate=false to see the search's own result only). Compare with the same searches without
settling (benchmarks/results/search_ablation.json at 24 steps, repair_candidates.json at 96).
Writes --out (default benchmarks/results/search_settle_<scenario>_steps<search.steps>.json).

    # the committed 24-step run (benchmarks/results/search_settle_rtx5070_coding.json, code 606e438)
    .venv/bin/python benchmarks/search_settle.py --scenario rtx5070_coding --settle 32 \
        --out benchmarks/results/search_settle_rtx5070_coding.json search.steps=24 search.candidates=3 \
        search.probe_sequences=4 search.homogeneous_candidate=false data.source=jsonl data.path=../shared/data/corpora/c4_sample
    .venv/bin/python benchmarks/search_settle.py --scenario rtx5070_coding --settle 32 --settle-lr 1 0.1 \
        --setting 0:2.0:0 \
        search.homogeneous_candidate=false data.source=jsonl data.path=../shared/data/corpora/c4_sample
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import common
import torch
from common import scored

from autocompress.arch.masking import MaskedModel
from autocompress.config.compose import compose_spec
from autocompress.errors import ConfigError
from autocompress.io import write_json
from autocompress.search.differentiable import run_search
from autocompress.search.prepare import prepare

SETTINGS = [(0.1, 0.5, 0), (0.0, 0.5, 1)]  # margin, dual step, seed: the search_quality settings of the 24-step run


def parse_setting(text: str) -> tuple[float, float, int]:
    """MARGIN:DUAL_STEP:SEED, e.g. 0:2.0:0."""
    try:
        margin, dual, seed = text.split(":")
        return float(margin), float(dual), int(seed)
    except ValueError:
        raise SystemExit(f"--setting {text!r}: give MARGIN:DUAL_STEP:SEED, e.g. 0:2.0:0") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--settle", type=int, default=32, help="search.settle_steps")
    parser.add_argument("--settle-lr", type=float, nargs="+", default=[1.0], help="search.settle_lr values, each a run")
    parser.add_argument("--setting", action="append", default=[], help="MARGIN:DUAL_STEP:SEED (default: the two of search_quality)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--note", default="", help="what else shared the machine")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/search_settle_<scenario>_steps<N>.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides")
    args = parser.parse_args()
    record = common.Record(args.note)
    given = [parse_setting(s) for s in args.setting] or SETTINGS
    if any(not 0 < lr <= 1 for lr in args.settle_lr):
        raise SystemExit(f"--settle-lr {args.settle_lr}: each value must be in (0, 1]")
    spec = compose_spec(f"+scenario={args.scenario}", *args.overrides)
    base = spec.search.settings  # each setting changes only margin, dual step and seed of the configured settings
    try:
        settings_list = [dataclasses.replace(base, margin=m, dual_lr=d, seed=sd) for m, d, sd in given]
    except ConfigError as exc:
        raise SystemExit(f"--setting: {exc}") from None
    path = args.out or Path(f"benchmarks/results/search_settle_{args.scenario}_steps{spec.search.steps}.json")
    if path.is_dir():
        raise SystemExit(f"--out {path} is a folder; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)  # a bad folder fails now, not after an hour of searches
    torch.set_num_threads(args.threads)
    p = prepare(spec, progress=False)
    model, inputs, cm, space = p.base.model, p.inputs, p.cost_model, p.space
    rows: list[dict[str, Any]] = []
    command = f"benchmarks/search_settle.py --scenario {args.scenario} --settle {args.settle}"
    command += " --settle-lr " + " ".join(map(str, args.settle_lr)) + "".join(f" --setting {s}" for s in args.setting)
    command += (f" --out {args.out}" if args.out else "") + " " + " ".join(args.overrides)
    run = {"command": command.strip()}
    for settings in settings_list:
        for lr in args.settle_lr:
            start = time.time()
            search = dataclasses.replace(spec.search, settle_steps=args.settle, settle_lr=lr)
            res = run_search(model, inputs, cm, search, settings)
            masked = MaskedModel(model, space, inputs.ranking)
            row: dict[str, Any] = {"settings": dataclasses.asdict(settings), "settle_lr": lr, "settle_steps": res.settle_steps}
            row |= {"repair_steps": res.repair_steps, "fill_steps": res.fill_steps, "origin": res.origin}
            for key, arch in (("argmax", res.argmax), ("repaired", res.repaired), ("final", res.architecture)):
                assert arch is not None
                row[key] = scored(model, masked, inputs, cm, arch)  # search_quality's row: KL on both splits, costs, shape
            masked.remove()
            row["wall_s"] = time.time() - start
            rows.append(row)
            print(json.dumps(row), flush=True)
            run["_record"] = record.as_dict()
            out = {"scenario": args.scenario, "settle": args.settle, "search": dataclasses.asdict(spec.search), "runs": rows, "_run": run}
            write_json(out, path)  # after every run: an interrupted benchmark keeps what it measured


if __name__ == "__main__":
    main()
