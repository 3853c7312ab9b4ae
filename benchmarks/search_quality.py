"""Does the search beat baselines that could win, at the same predicted constraint? Report-split KL, no retraining.

For each scenario: the search with a few Lagrangian settings (the one with the lowest
selection-split KL is "searched": with search.homogeneous_candidate, the default, each search keeps the
filled homogeneous rival instead of its own result where that has the lower selection KL, and
"search_only" is the best of the searches' own results), and at the same absolute constraints under
the same cost model:
- homogeneous_full_kv: full hidden size and every head, one FFN width in all kept layers, the
  fewest least-important blocks dropped that fit; the width with the lowest selection KL;
- greedy: attention/FFN sublayers removed least important first until feasible;
- cost_only: the search with its KL term off (the picked setting's Lagrangian, kl_weight=0), search.fill off
  and repair measuring 1 candidate (so no move is chosen by measured KL);
- argmax_before_repair: the picked search's most probable architecture before repair (may be
  infeasible: its feasibility and every search's repair and fill steps are recorded);
- minitron: the ModelOpt mcore_minitron baseline (autocompress.baselines.minitron) at the same constraints;
- puzzletron: the ModelOpt puzzletron baseline (autocompress.baselines.puzzletron: block library, one-block scores on
  the selection split, MIP, realised and tightened) at the same constraints.
Every KL is on the report split; choices among candidates use the selection split only.
Writes benchmarks/results/search_quality.json (the table) and --out (details); prints Markdown.

    .venv/bin/python benchmarks/search_quality.py --scenario rtx5070_coding data.source=jsonl data.path=../shared/data/corpora/c4_sample

`--only puzzletron` runs that baseline alone and adds its row to the scenario's existing one (the other rows stay as
they were measured; the bounds of both runs are recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import time
from pathlib import Path
from typing import Any

import common
import torch
from common import SETTINGS, scored, shape

from autocompress.arch.importance import importance, sublayer_order
from autocompress.arch.masking import MaskedModel
from autocompress.baselines.minitron import MinitronSpec
from autocompress.baselines.minitron import search as minitron_search
from autocompress.baselines.naive import greedy_removal
from autocompress.baselines.puzzletron import PuzzletronSpec
from autocompress.baselines.puzzletron import search as puzzletron_search
from autocompress.config.compose import compose_spec
from autocompress.config.schema import LagrangianSettings
from autocompress.cost import CostModel
from autocompress.cost.base import meets
from autocompress.search.differentiable import SearchInputs, evaluate, run_search
from autocompress.search.prepare import prepare
from autocompress.search.rival import homogeneous_full_kv

TABLE = ("searched", "search_only", "homogeneous_full_kv", "greedy", "cost_only", "argmax_before_repair", "minitron", "puzzletron")
ONLY = ("puzzletron",)  # baselines that can run alone (--only) and join an existing row


def puzzletron_row(model: Any, inputs: SearchInputs, cm: CostModel) -> dict[str, Any]:
    """Puzzletron's pick at the same bounds: its report-split KL, shape, and every MIP solve."""
    space = inputs.space
    start = time.time()
    res = puzzletron_search(
        model, space, cm, inputs.constraints, inputs.calib, inputs.select, inputs.teacher_select, PuzzletronSpec(), False
    )
    masked = MaskedModel(model, space, res.ranking)
    kl, ppl = evaluate(model, masked, res.arch, inputs.report, inputs.teacher_report)
    masked.remove()
    slack = {c.metric: res.costs[c.metric] / c.value - 1 for c in inputs.constraints}  # < 0 below an upper bound
    return {
        "kl": kl,
        "kl_select": res.kl_select,
        "perplexity": ppl,
        "params": res.arch.num_params(),
        "feasible": meets(cm, inputs.constraints, res.arch),
        **res.costs,
        **shape(res.arch),
        **res.shape(),
        "relative_to_bound": slack,
        "solves": len(res.solves),
        "overshoots": [s["overshoot"] for s in res.solves],
        "settings": res.settings,
        "wall_s": time.time() - start,
    }


def bench_scenario(
    name: str, n_settings: int, overrides: list[str], searches_only: bool = False, only: str | None = None
) -> dict[str, Any]:
    spec = compose_spec(f"+scenario={name}", *overrides)
    prep = prepare(spec, progress=False)
    model, inputs, cm, space = prep.base.model, prep.inputs, prep.cost_model, prep.space
    cons = inputs.constraints
    out: dict[str, Any] = {"scenario": name, "constraints": {c.metric: c.value for c in cons}, "cost_model": cm.id}
    if only == "puzzletron":
        return out | {"puzzletron": puzzletron_row(model, inputs, cm)}
    masked = MaskedModel(model, space, inputs.ranking)

    score = functools.partial(scored, model, masked, inputs, cm)

    searches = []
    for settings in SETTINGS[:n_settings]:
        res = run_search(model, inputs, cm, spec.search, settings)
        extra = {"settings": dataclasses.asdict(settings), "repair_steps": res.repair_steps, "fill_steps": res.fill_steps}
        row = score(res.architecture, extra | {"origin": res.origin})
        assert res.searched is not None
        own = row if res.origin == "search" else score(res.searched, extra | {"origin": "search"})
        searches.append((res, row, own))
        print(f"{name}: searched {settings}: kl={row['kl']:.3f} ({res.origin}), own kl={own['kl']:.3f} ({res.wall_s:.0f}s)", flush=True)
    best_res, best, _ = min(searches, key=lambda s: s[1]["kl_select"])
    out["searches"] = [row for _, row, _ in searches]
    out["searches_own"] = [own for _, _, own in searches]
    out["searched"] = best
    out["search_only"] = min((own for _, _, own in searches), key=lambda r: r["kl_select"])
    assert best_res.argmax is not None
    out["argmax_before_repair"] = score(best_res.argmax, {"repair_steps": best_res.repair_steps})
    if searches_only:  # an ablation of the search's own settings: the baselines do not change with them
        out |= {"cost_only": None, "homogeneous_full_kv": None, "greedy": None, "minitron": None, "puzzletron": None}
        masked.remove()
        return out
    settings = LagrangianSettings(**best["settings"])
    # blind to quality after the search too: fill off (it grows a result by the moves with the lowest measured
    # KL; with 8 candidates it rebuilt much of a cost-only result) and repair taking the move its own (cost-only)
    # distributions rank first instead of measuring candidates by KL
    blind = dataclasses.replace(spec.search, fill=False, candidates=1)
    cost_only = run_search(model, dataclasses.replace(inputs, homogeneous=None), cm, blind, settings, kl_weight=0.0)
    out["cost_only"] = score(cost_only.architecture, {"repair_steps": cost_only.repair_steps, "fill": False})
    imp = importance(model, inputs.calib[: spec.search.importance_sequences], progress=False)
    archs = homogeneous_full_kv(space, imp.drop_order(), cm, cons)
    homog = [score(a, report=False) for a in archs]  # chosen on the selection split; only the choice is reported
    out["homogeneous_candidates"] = homog
    pick = min(range(len(homog)), key=lambda i: homog[i]["kl_select"]) if homog else None
    out["homogeneous_full_kv"] = None if pick is None else score(archs[pick])
    greedy = greedy_removal(space, sublayer_order(model, inputs.calib[: spec.search.importance_sequences]), cm, cons)
    out["greedy"] = None if greedy is None else score(greedy)
    masked.remove()
    mt = minitron_search(model, space, cm, cons, inputs.calib, inputs.select, inputs.teacher_select, MinitronSpec(), progress=False)
    mmask = MaskedModel(model, space, mt.ranking)
    kl, ppl = evaluate(model, mmask, mt.best.arch, inputs.report, inputs.teacher_report)
    mmask.remove()
    out["minitron"] = {"kl": kl, "perplexity": ppl, "params": mt.best.params, "limits": mt.limits, "feasible": True, **shape(mt.best.arch)}
    out["puzzletron"] = puzzletron_row(model, inputs, cm)
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| scenario | " + " | ".join(TABLE) + " | repair steps per search |", "|---|" + "---|" * (len(TABLE) + 1)]
    for r in results:
        cells = []
        for key in TABLE:
            row = r.get(key)
            cells.append("n/a" if row is None else f"{row['kl']:.3f}" + ("" if row["feasible"] else " (infeasible)"))
        steps = ", ".join(str(s["repair_steps"]) for s in r.get("searches", []))
        lines.append(f"| {r['scenario']} | " + " | ".join(cells) + f" | {steps} |")
    lines += ["", "Shapes (attention: KV heads per layer, '-' = no-op; FFN width / 128):", ""]
    for r in results:
        for key in ("searched", "search_only", "homogeneous_full_kv", "minitron", "puzzletron"):
            row = r.get(key)
            if row is not None:
                ffn = " ".join("-" if f == 0 else f"{f // 128}" for f in row["ffn"])
                lines.append(
                    f"- **{r['scenario']} {key}**: hidden {row['hidden']}, {row['query_heads']} query heads, {row['params'] / 1e6:.1f}M"
                )
                lines.append(f"  - attention `{row['attention']}`; FFN `{ffn}`")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", required=True)
    parser.add_argument("--settings", type=int, default=len(SETTINGS), help="how many of the Lagrangian settings to search with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--searches-only", action="store_true", help="only the searches (an ablation of search.*): no baselines")
    parser.add_argument("--only", choices=ONLY, help="this baseline alone, added to the scenario's existing row")
    parser.add_argument("--out", default="benchmarks/out/search_quality.json")
    parser.add_argument("--table", default="benchmarks/results/search_quality.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. search.steps=24")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.record = common.Record()
    results = []
    for name in args.scenario:
        start = time.time()
        results.append(bench_scenario(name, args.settings, args.overrides, args.searches_only, args.only) | {"wall_s": time.time() - start})
        new = joined(json.loads(Path(args.table).read_text()), results, args) if args.only else table(results, args)
        for path, data in ((Path(args.out), results), (Path(args.table), new)):
            path.parent.mkdir(parents=True, exist_ok=True)
            if path == Path(args.table) and path.exists():  # other scenarios' rows stay; this run's replace theirs
                data = merged(json.loads(path.read_text()), data)
            path.write_text(json.dumps(data, indent=1))
    print(markdown(results))


def run_record(args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    """How one scenario's row was made: the command, and the run's commit, CPU, date and machine share (`_record`)."""
    cmd = f"benchmarks/search_quality.py --scenario {scenario}" + (f" --only {args.only}" if args.only else "")
    return {
        "command": (cmd + " " + " ".join(args.overrides)).strip(),
        "machine": platform.machine(),
        "_record": args.record.as_dict(),
    }


def joined(old: dict[str, Any], results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The existing table with this run's `--only` baseline added to each scenario's row (the row's other entries kept)."""
    out: dict[str, Any] = {}
    meta = old.get("_meta", {"runs": {}})
    for r in results:
        key, pick = args.only, r[args.only]
        row = dict(old.get(r["scenario"], {}))
        row[key] = pick["kl"]
        row.setdefault("params", {})[key] = pick["params"]
        row[f"{key}_params"] = pick["params"]
        row[f"{key}_detail"] = {k: v for k, v in pick.items() if k not in ("kl", "params")} | {"constraints": r["constraints"]}
        out[r["scenario"]] = row
        meta["runs"].setdefault(r["scenario"], {})
        meta["runs"][r["scenario"]] = {**meta["runs"][r["scenario"]], key: run_record(args, r["scenario"])}
    out["_meta"] = meta
    return out


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`old` with `new`'s scenarios replacing or joining its own; `_meta` keeps one entry per scenario."""
    meta = {**old.get("_meta", {}).get("runs", {}), **new["_meta"]["runs"]}
    return {
        **{k: v for k, v in old.items() if k != "_meta"},
        **{k: v for k, v in new.items() if k != "_meta"},
        "_meta": {**new["_meta"], "runs": meta},
    }


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """{scenario: {baseline: report-split KL (None where no architecture fits), ...}} plus how it was made."""
    out: dict[str, Any] = {}
    for r in results:
        row: dict[str, Any] = {k: None if r[k] is None else r[k]["kl"] for k in TABLE}
        if r["puzzletron"] is not None:
            row["puzzletron_params"] = r["puzzletron"]["params"]
            row["puzzletron_detail"] = {k: v for k, v in r["puzzletron"].items() if k not in ("kl", "params")}
        row["argmax_before_repair_feasible"] = r["argmax_before_repair"]["feasible"]
        row["origin"] = r["searched"].get("origin", "search")
        row["repair_steps"] = [s["repair_steps"] for s in r["searches"]]
        row["fill_steps"] = [s.get("fill_steps", 0) for s in r["searches"]]
        row["params"] = {k: None if r[k] is None else r[k]["params"] for k in TABLE}
        row["minitron_limits"] = r["minitron"]["limits"] if r["minitron"] else None
        row["wall_s"] = r["wall_s"]
        out[r["scenario"]] = row
    cmd = "benchmarks/search_quality.py " + " ".join(f"--scenario {s}" for s in args.scenario) + " " + " ".join(args.overrides)
    run = {"command": cmd.strip(), "machine": platform.machine(), "_record": args.record.as_dict()}
    runs = {r["scenario"]: run for r in results}
    out["_meta"] = {"metric": "report-split KL to the unpruned model, nats/token, no retraining", "runs": runs}
    return out


if __name__ == "__main__":
    main()
