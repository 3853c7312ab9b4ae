"""Issue 15 item 7: which step after the search moves report-split KL at the same constraint?

One search per Lagrangian setting (search_quality.SETTINGS), then every way of turning its final
distributions into a feasible architecture, all from that one search:
- argmax: the most probable architecture (may break a bound);
- repair_probe1: downgraded until feasible, moves measured by KL on 1 calibration sequence (the
  method before this ablation);
- repair_probe1_fill / repair / repair_fill: the same with fill (upgrades into the slack left inside
  the margin-tightened bounds) and/or search.probe_sequences calibration sequences (the default).
Each variant's pick over the settings is the one with the lowest selection-split KL; its report-split
KL is what the table compares (the homogeneous full-KV baseline and Minitron: see search_quality.json).
Writes benchmarks/results/search_ablation.json (merging scenarios) and prints Markdown.

    .venv/bin/python benchmarks/search_ablation.py --scenario rtx5070_coding data.source=jsonl data.path=../shared/data/corpora/c4_sample
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
from common import SETTINGS, shape

from autocompress.arch.masking import MaskedModel
from autocompress.arch.space import Architecture
from autocompress.config.compose import compose_spec
from autocompress.cost.base import meets
from autocompress.search.differentiable import evaluate, fill, repair, run_search
from autocompress.search.prepare import prepare

VARIANTS = ("argmax", "repair_probe1", "repair_probe1_fill", "repair", "repair_fill")


def bench_scenario(name: str, n_settings: int, overrides: list[str]) -> dict[str, Any]:
    spec = compose_spec(f"+scenario={name}", *overrides)
    prep = prepare(spec, progress=False)
    model, inputs, cm, space = prep.base.model, prep.inputs, prep.cost_model, prep.space
    cons = inputs.constraints
    out: dict[str, Any] = {"scenario": name, "probe_sequences": spec.search.probe_sequences, "settings": []}
    for settings in SETTINGS[:n_settings]:
        start = time.time()
        res = run_search(model, inputs, cm, dataclasses.replace(spec.search, fill=True), settings)
        assert res.argmax is not None and res.repaired is not None
        masked = MaskedModel(model, space, inputs.ranking)
        probe1 = inputs.calib[:1], inputs.teacher_calib[:1]

        def quality1(a: Architecture, masked: MaskedModel = masked, probe1: tuple = probe1) -> float:
            return evaluate(model, masked, a, *probe1)[0]

        rep1, steps1 = repair(res.argmax, space, cm, cons, res.logits, quality1, spec.search.candidates)
        fill1, fills1 = fill(rep1, space, cm, cons, res.logits, quality1, settings.margin, spec.search.candidates)
        archs = {
            "argmax": (res.argmax, 0, 0),
            "repair_probe1": (rep1, steps1, 0),
            "repair_probe1_fill": (fill1, steps1, fills1),
            "repair": (res.repaired, res.repair_steps, 0),
            "repair_fill": (res.architecture, res.repair_steps, res.fill_steps),
        }
        row: dict[str, Any] = {"settings": settings.__dict__, "search_s": res.wall_s}
        for key, (arch, repairs, fills) in archs.items():
            kl_sel, _ = evaluate(model, masked, arch, inputs.select, inputs.teacher_select)
            kl, ppl = evaluate(model, masked, arch, inputs.report, inputs.teacher_report)
            row[key] = {
                "kl": kl,
                "kl_select": kl_sel,
                "perplexity": ppl,
                "params": arch.num_params(),
                "feasible": meets(cm, cons, arch),
                "repair_steps": repairs,
                "fill_steps": fills,
                **cm.predict(arch),
                **shape(arch),
            }
        masked.remove()
        row["wall_s"] = time.time() - start
        out["settings"].append(row)
        print(f"{name} {settings}: " + ", ".join(f"{k} {row[k]['kl']:.3f}" for k in VARIANTS) + f" ({row['wall_s']:.0f}s)", flush=True)
    for key in VARIANTS:
        rows = [r[key] for r in out["settings"] if r[key]["feasible"] or key == "argmax"]
        out[key] = min(rows, key=lambda r: r["kl_select"]) if rows else None
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| scenario | setting | " + " | ".join(VARIANTS) + " |", "|---|---|" + "---|" * len(VARIANTS)]
    for r in results:
        for row in r["settings"]:
            s = row["settings"]
            cells = [f"{row[k]['kl']:.3f} ({row[k]['params'] / 1e6:.0f}M{'' if row[k]['feasible'] else ', infeasible'})" for k in VARIANTS]
            lines.append(
                f"| {r['scenario']} | margin {s['margin']}, dual_lr {s['dual_lr']}, seed {s['seed']} | " + " | ".join(cells) + " |"
            )
        picked = [("n/a" if r[k] is None else f"**{r[k]['kl']:.3f}**") for k in VARIANTS]
        lines.append(f"| {r['scenario']} | pick (lowest selection KL) | " + " | ".join(picked) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", required=True)
    parser.add_argument("--settings", type=int, default=len(SETTINGS), help="how many of the Lagrangian settings to search with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--note", default="", help="what else shared the machine (recorded beside the CPU)")
    parser.add_argument("--table", default="benchmarks/results/search_ablation.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. search.steps=24")
    args = parser.parse_args()
    record = common.Record(args.note)
    torch.set_num_threads(args.threads)
    path = Path(args.table)
    table: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    results = []
    for name in args.scenario:
        start = time.time()
        result = bench_scenario(name, args.settings, args.overrides)
        command = f"benchmarks/search_ablation.py --threads {args.threads} --scenario {name} " + " ".join(args.overrides)
        result["_run"] = {"command": command.strip(), "_record": record.as_dict(), "wall_s": time.time() - start}
        results.append(result)
        table[name] = result
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1))
    print(markdown(results))


if __name__ == "__main__":
    main()
