"""compare's outputs: compare.parquet (a row per model, runner-ups included), diff.parquet / diffs.parquet (AutoCompress
minus each baseline, a bootstrap over items and seeds), compare.md and compare.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pandas as pd

from autocompress.baselines.comparison import CompareJob, Model, markdown, model_row, paired_bootstrap, title
from autocompress.baselines.context import Context
from autocompress.io import write_json, write_parquet, write_text

RECORDED = (  # what compare.json keeps of each baseline's <name>.json (what the pick recorded of its shape and choice)
    "label",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "attention",
    "ffn",
    "experts",
    "expert_ffn",
    "shared_ffn",
    "dropped_blocks",
    "limits",
    "blocks",
    "solves",
    "kl_select",
    "kl_report",
    "budget",
)


def write_outputs(
    job: CompareJob, ctx: Context, out: Path, models: list[Model], note: str, timings: dict[str, Any], runner_ups: list[Model] | None = None
) -> None:
    """compare.parquet (one row per model, runner-ups included), diffs, compare.md and compare.json."""
    shown = runner_ups or []  # each method's second by its own selection score, shown beside it
    frame = pd.DataFrame([model_row(m, ctx.constraints) for m in [*models, *shown]])
    ac, others = models[1], {m.name: m for m in models[2:]}
    diffs = {
        name: paired_bootstrap([r.items for r in ac.results], [r.items for r in m.results], job.compare.bootstrap, job.compare.seed)
        for name, m in others.items()
    }
    write_parquet(frame, out / "compare.parquet")
    first = next(iter(diffs))  # diff.parquet: against the first baseline (Minitron unless compare.methods says otherwise)
    write_parquet(pd.concat([d.assign(method=n) for n, d in diffs.items()], ignore_index=True), out / "diffs.parquet")
    write_parquet(diffs[first], out / "diff.parquet")
    text = markdown(frame, diffs, ctx.constraints, note, job)
    title_ = " vs ".join(title(m.name) for m in models[1:])
    write_text(f"# {title_}: `{ctx.spec.scenario.name}`\n\n" + text, out / "compare.md")
    diff_vs = {}
    for name, d in diffs.items():
        avg = d.set_index("task").loc["average"]
        diff_vs[name] = {"mean": float(avg["diff"]), "low": float(avg["lo"]), "high": float(avg["hi"])}
    baselines: dict[str, Any] = {}
    for name, m in others.items():
        done = json.loads((out / name / f"{name}.json").read_text())
        recorded = {k: done[k] for k in RECORDED if k in done}
        baselines[name] = {"params": m.arch.num_params(), "average": 100 * m.score("average"), **recorded, **_test_means(m)}
    second_of = {m.name.split("/")[0]: _runner_up_entry(m) for m in shown}
    for name, entry in second_of.items():
        if name in baselines:
            baselines[name]["runner_up"] = entry
    write_json(
        {
            "scenario": ctx.spec.scenario.name,
            "autocompress": {
                "trial": ctx.row["trial_id"],
                "params": ac.arch.num_params(),
                "average": 100 * ac.score("average"),
                "origin": None if pd.isna(ctx.row.get("origin")) else str(ctx.row.get("origin")),
                "budget": _autocompress_budget(ctx),
                **_test_means(ac),
                **({"runner_up": second_of["autocompress"]} if "autocompress" in second_of else {}),
            },
            **baselines,
            "methods": list(job.compare.methods or ()),
            "diff": {**diff_vs[first], "vs": first},
            "diff_vs": diff_vs,
            "seeds": list(job.compare.seeds),
            "run": str(ctx.run.path),
            "trial": ctx.row["trial_id"],
            "seconds": timings,
            "measure": note,
            "distill": dataclasses.asdict(job.distill),
            "evaluate": dataclasses.asdict(job.evaluate),
            "probe": _probe_summary(job, out),
        },
        out / "compare.json",
    )
    print(text)
    print("seconds per stage: " + ", ".join(f"{k} {v if isinstance(v, str) else f'{v:.0f}'}" for k, v in timings.items()))
    print(f"\ntable: {out / 'compare.md'} (data: {out / 'compare.parquet'}, {out / 'diff.parquet'})")


def _autocompress_budget(ctx: Context) -> dict[str, Any]:
    """What AutoCompress's pick cost on the selection split: each finished trial's result is scored on all of it once (its
    homogeneous rival too, where the trial's fill or repair moved it); the searches themselves read calibration text."""
    trials = ctx.run.trials
    finished = int((trials["status"] == "ok").sum())
    note = "one per finished trial; not counted: the homogeneous rival's preparation and rivals re-scored after a move"
    return {"trials": len(trials), "selection_evaluations": finished, "selection_sequences": len(ctx.data.select), "note": note}


def _runner_up_entry(m: Model) -> dict[str, Any]:
    """What compare.json keeps of a runner-up: its label, size, benchmark average and test-split scores."""
    return {"label": m.label, "params": m.arch.num_params(), "average": 100 * m.score("average"), "kl_pruned": m.kl, **_test_means(m)}


def _test_means(m: Model) -> dict[str, float]:
    """compare.test_split's scores, means over the distillation seeds (none when it is off)."""
    return {"test_kl": m.test_mean("kl"), "test_perplexity": m.test_mean("perplexity")} if m.test else {}


def _probe_summary(job: CompareJob, out: Path) -> dict[str, Any] | None:
    """compare.probe's settings and every probed candidate of each method (None when the probe was off)."""
    probe = job.compare.probe
    if not probe.on:
        return None
    ac = json.loads((out / "autocompress" / "probe.json").read_text()) if job.compare.trial is None else None
    summary = {**dataclasses.asdict(probe), "autocompress": ac["candidates"] if ac else "compare.trial was given: not probed"}
    from autocompress.baselines.interface import BASELINES

    for name in job.compare.methods or ():
        if name not in BASELINES or not BASELINES[name].probes:
            continue
        if (out / name / "candidates.parquet").exists():  # a table of every scored candidate (Minitron)
            cands = pd.read_parquet(out / name / "candidates.parquet")
            cands = cands[cands["kl_select_probe"].notna()]
            columns = ["params", "kl", "kl_select_probe", "chosen", "architecture"]
            summary[name] = [{**r, "kl_select": r.pop("kl")} for r in cands[columns].to_dict("records")]
        else:  # the pick's own record of its probe (Puzzletron: the MIP's N best choices)
            summary[name] = json.loads((out / name / f"{name}.json").read_text()).get("probe")
    return summary
