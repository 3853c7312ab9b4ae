"""`python -m autocompress.report RUN_DIR [RUN_DIR ...] [--out DIR] [--overwrite]`: a Markdown report (and the same as report.html)
with PNG figures, and the key table.

One run: RUN_DIR/report/. Several runs (of one scenario or several): a `report/` folder beside
them, under their common parent. The folder is built beside its place and renamed into it, so a
report folder never holds half a report; an earlier report there is refused unless --overwrite.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from autocompress.charts.figures import (
    COST_LABELS,
    compare_architectures,
    cost_name,
    cost_unit,
    fmt_params,
    is_baseline,
    pareto_info,
    pareto_table,
    quality_label,
    quality_metrics,
    run_architectures,
    summary_table,
)
from autocompress.charts.plots import plot_architectures, plot_pareto, save
from autocompress.config.cliargs import guarded
from autocompress.io import RunPaths, markdown, staged, write_text
from autocompress.results.pareto import COST_DIRECTIONS
from autocompress.results.store import Run, RunFolderError, load_run

OPS = {"max": "≤", "min": "≥"}


# --------------------------------------------------------------------------- formatting


def fmt_value(v: object) -> str:
    """Four significant digits for floats, thousands separators for big ones, blanks for missing."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 10_000 else f"{v:.4g}"
    return str(v)


def display(table: pd.DataFrame) -> pd.DataFrame:
    """A table as strings with readable headers (params in millions)."""
    out = table.copy().astype(object)
    if "params" in out:
        out["params"] = [fmt_params(p) for p in out["params"]]
    for col in [c for c in out.columns if c.endswith("_share")]:
        out[col] = [f"{v:.2f}x" if isinstance(v, float) and not math.isnan(v) else "" for v in out[col]]
    headers = {
        **{c: COST_LABELS[c] for c in COST_DIRECTIONS},
        **{f"measured_{c}": f"measured {COST_LABELS[c]}" for c in COST_DIRECTIONS},
        **{f"{c}_share": cost_name(c) for c in COST_DIRECTIONS},
        "params_share": "params",
        "num_attention_kept": "attn kept",
        "num_ffn_kept": "ffn kept",
        "hidden_size": "hidden",
        "best_kl": "best KL",
        "on_front": "on front",
        "kl": "KL",
    }
    out = out.rename(columns=headers)
    return out.map(fmt_value) if hasattr(out, "map") else out.applymap(fmt_value)


def markdown_table(table: pd.DataFrame) -> str:
    return markdown(display(table))


def terminal_table(table: pd.DataFrame) -> str:
    return display(table).to_string(index=False) if len(table) else "(no feasible trial on a front)"


# --------------------------------------------------------------------------- one run


def cost_model_name(recorded: object) -> str:
    """One line for the cost model a run recorded: its id, and a fitted model's file by name (no local path, no dict)."""
    if not isinstance(recorded, dict):
        return str(recorded)
    name = str(recorded.get("id", "?"))
    file = recorded.get("file")
    return f"{name}, fitted: {Path(str(file)).name}" if file else name


def describe_run(run: Run) -> list[str]:
    """Markdown lines: what the run optimised for and how its trials ended."""
    meta, spec = run.metadata, run.spec
    lines = []
    if spec is not None:
        w = spec.scenario.workload
        lines.append(
            f"- deployment: {spec.scenario.hardware.name}, workload {w.name} (prompt {w.prompt_len}, output {w.output_len}, "
            f"concurrency {w.concurrency}, {w.dtype})"
        )
    base_params = meta.get("base_params")
    size = f" ({base_params / 1e6:.1f}M parameters)" if base_params else ""
    cost_model = f"; cost model `{cost_model_name(meta['cost_model'])}`" if meta.get("cost_model") else ""
    lines.append(f"- model: {meta.get('model', '?')}{size}{cost_model}")
    bounds = []
    for metric, c in run.constraints.items():
        base = run.base_costs.get(metric)
        share = f" ({c.value / base:.2f}x base)" if base else ""
        bounds.append(f"{cost_name(metric)} {OPS[c.sense]} {fmt_value(c.value)} {cost_unit(metric)}{share}")
    lines.append(f"- constraints (predicted costs): {'; '.join(bounds) or 'none'}")
    lines.append(f"- {_counts(run)}")
    return lines


def _counts(run: Run) -> str:
    t = run.trials[~is_baseline(run.trials)]
    ok = t[t["status"] == "ok"]
    on_front = int((~is_baseline(run.pareto)).sum())
    text = f"trials: {len(t)}, finished {len(ok)}, feasible {int(ok['feasible'].sum())}, on a Pareto front {on_front}"
    errors = t[t["status"] != "ok"]
    if len(errors):
        first = str(errors["error"].iloc[0]).strip().splitlines()[-1:] or [""]
        text += f"; {len(errors)} failed (last line of the first error: `{first[0][:200]}`)"
    return text


def draw_run(run: Run, out: Path, prefix: str) -> list[tuple[str, Path]]:
    """The run's figures: quality against every cost (one figure per quality metric), per-layer architectures."""
    written = []
    for quality in quality_metrics(run.trials):
        infos = [pareto_info(run, quality, cost) for cost in COST_DIRECTIONS]
        fig = plot_pareto(infos, f"{run.label}: {quality_label(quality)} against predicted cost")
        written.append((f"{quality_label(quality)} against each cost", save(fig, out / f"{prefix}pareto_{quality}.png")))
    arch = run_architectures(run)
    if arch.labels:
        fig = plot_architectures(arch, f"{run.label}: architectures on the joint Pareto front, best KL first")
        written.append(("per-layer architecture of the Pareto points", save(fig, out / f"{prefix}architectures.png")))
    return written


def run_section(run: Run, figures: list[tuple[str, Path]], out: Path) -> str:
    lines = [
        f"## {run.label}",
        "",
        *describe_run(run),
        "",
        "Points on the joint Pareto front (KL against every cost), best KL first; `index` is what "
        f"`python -m autocompress.export {run.path / 'pareto.parquet'} index=N` takes; `same_as` names an earlier point "
        "with the same architecture:",
        "",
    ]
    table = pareto_table(run)
    lines.append(markdown_table(table) if len(table) else "_No feasible trial: relax the constraints or widen the sweep._")
    for caption, path in figures:
        lines += ["", f"![{caption}]({path.relative_to(out).as_posix()})"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the report


def default_out(runs: Sequence[Run]) -> Path:
    """RUN_DIR/report for one run; a `report` folder under the runs' common parent for several."""
    if len(runs) == 1:
        return runs[0].path / "report"
    return Path(os.path.commonpath([str(r.path.parent) for r in runs])) / "report"


def slug(run: Run) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{run.scenario}_{run.run_id}") + "_"


def write_report(runs: Sequence[Run], out: Path, overwrite: bool = False) -> Path:
    """Figures, then report.md, built in a folder beside `out` that becomes `out` whole; returns the path of report.md.
    An existing `out` is refused unless `overwrite` (and then only a report folder is replaced)."""
    made = [p for p in out.parents if not p.exists()]
    try:
        with staged(out, overwrite, key="--out", marker="report.md", what="a report", flag="--overwrite") as tmp:
            tmp.mkdir()
            many = len(runs) > 1
            sections = [run_section(run, draw_run(run, tmp, slug(run) if many else ""), tmp) for run in runs]
            head = ["# AutoCompress report", "", "Runs: " + ", ".join(f"`{r.path}`" for r in runs), ""]
            if many:
                head += summary_section(runs, tmp)
            text = "\n".join(head) + "\n" + "\n\n".join(sections) + "\n"
            write_text(html_page(text), tmp / "report.html")  # the same report for a browser, its figures beside it
            write_text(text, tmp / "report.md")
    except BaseException:
        for folder in made:  # innermost first: no empty folders left by a report that was never written
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return out / "report.md"


HTML_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;line-height:1.45}"
    "table{border-collapse:collapse;margin:1rem 0;font-size:.9rem}th,td{border:1px solid #ccc;padding:.25rem .5rem;"
    "text-align:right}th{background:#f3f3f3}img{max-width:100%}code{background:#f3f3f3;padding:0 .2rem}"
)


def html_page(markdown: str) -> str:
    """report.md as one HTML page (tables, figures by their relative paths), for a browser or a shared folder."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)
    head = f'<meta charset="utf-8"><title>AutoCompress report</title><style>{HTML_STYLE}</style>'
    return f"<!DOCTYPE html>\n<html><head>{head}</head><body>\n{body}</body></html>\n"


def summary_section(runs: Sequence[Run], out: Path) -> list[str]:
    """Markdown lines across runs: the summary table and the chosen architectures side by side."""
    lines = ["## Summary", "", "The chosen point of each run (feasible, lowest KL), costs relative to its base model:", ""]
    lines += [markdown_table(summary_table(runs)), ""]
    compare = compare_architectures(runs)
    if compare.labels:
        fig = plot_architectures(compare, "chosen architecture of each run (feasible, lowest KL)")
        lines += [f"![chosen architectures side by side]({save(fig, out / 'compare_architectures.png').name})", ""]
    return lines


def key_tables(runs: Sequence[Run]) -> str:
    """What the terminal shows: the summary across runs (when several), then each run's Pareto points."""
    parts = []
    if len(runs) > 1:
        parts.append("summary (chosen point of each run, costs relative to its base model):\n" + terminal_table(summary_table(runs)))
    for run in runs:
        parts.append(f"{run.label}: joint Pareto front, best KL first\n{terminal_table(pareto_table(run))}")
    return "\n\n".join(parts)


def without_reports(paths: Sequence[Path]) -> list[Path]:
    """The paths minus earlier report folders (a glob such as results/<scenario>/* matches them too)."""
    reports = [p for p in paths if (p / "report.md").exists() and not RunPaths(p).metadata_file.exists()]
    if reports:
        print(f"skipping report folders: {', '.join(map(str, reports))}", file=sys.stderr)
    runs = [p for p in paths if p not in reports]
    if not runs:
        raise RunFolderError("only report folders were given; give sweep run folders: results/<scenario>/<run_id>")
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autocompress.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="sweep run folders: results/<scenario>/<run_id>")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default: RUN_DIR/report, or report/ beside several runs)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier report in that folder (refused otherwise)")
    args = parser.parse_args(argv)

    def body() -> None:
        runs = list({r.path: r for r in (load_run(p) for p in without_reports(args.run_dirs))}.values())
        report = write_report(runs, (args.out or default_out(runs)).resolve(), args.overwrite)
        print(key_tables(runs))
        print(f"\nreport: {report}")

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main())
