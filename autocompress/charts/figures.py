"""Data behind every report figure and table, computed apart from drawing (as optuna's plot modules are).

Each function takes a finished `Run` (or several) and returns DataFrames or a NamedTuple that
`plots.py` renders and the tests check without rendering. Columns added by later stages are drawn
when present and ignored when absent:

- `measured_<cost>` (costs measured by `verify`): drawn beside the predicted point;
- `accuracy` / `accuracy_<task>` (evaluation): one more quality axis, higher is better;
- `baseline` (a non-empty name such as `minitron`): the row is a reference architecture, not a
  search trial, and is marked instead of being counted in the fronts;
- metadata `base_<quality>` (e.g. `base_perplexity`) and `base_architecture` (JSON): the unpruned
  model's quality (KL is 0 by definition) and shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd

from autocompress.arch.space import Architecture
from autocompress.config.families import FAMILIES, LLAMA
from autocompress.config.metrics import Constraint
from autocompress.results.pareto import COST_DIRECTIONS, pareto_mask
from autocompress.results.store import Run, layers, selection_quality

COST_LABELS: dict[str, str] = {
    "ttft_ms": "TTFT (ms)",
    "tpot_ms": "TPOT (ms)",
    "throughput_tok_s": "output throughput (tokens/s)",
    "memory_gib": "serving memory (GiB)",
}
QUALITY_LABELS: dict[str, str] = {
    "kl": "report-split KL to the base model (nats/token)",
    "perplexity": "report-split perplexity",
}


# --------------------------------------------------------------------------- column conventions


def quality_metrics(trials: pd.DataFrame) -> list[str]:
    """Quality columns with at least one value: kl, perplexity, then accuracy columns."""
    names = ["kl", "perplexity", *sorted(c for c in trials.columns if c == "accuracy" or c.startswith("accuracy_"))]
    return [c for c in names if c in trials.columns and trials[c].notna().any()]


def lower_is_better(quality: str) -> bool:
    return not quality.startswith("accuracy")


def quality_label(quality: str) -> str:
    if quality in QUALITY_LABELS:
        return QUALITY_LABELS[quality]
    task = quality.removeprefix("accuracy").lstrip("_")
    return f"accuracy ({task})" if task else "accuracy"


def is_baseline(df: pd.DataFrame) -> pd.Series:
    """Rows that are reference architectures (a non-empty `baseline` name), not search trials."""
    if "baseline" not in df.columns:
        return pd.Series(False, index=df.index)
    return df["baseline"].fillna("").astype(str).str.len() > 0


def searched(df: pd.DataFrame) -> pd.DataFrame:
    """Finished search trials (no errors, no baseline rows)."""
    return df[(df["status"] == "ok") & ~is_baseline(df)]


def short_ids(trial_ids: Sequence[str]) -> list[str]:
    """Short point labels: Ray's `ef49b_00007` -> `7` when that stays unique, else the full id."""
    shorts = []
    for t in trial_ids:
        tail = str(t).rsplit("_", 1)[-1]
        shorts.append(str(int(tail)) if tail.isdigit() else str(t))
    return shorts if len(set(shorts)) == len(shorts) else [str(t) for t in trial_ids]


def point_names(run: Run) -> dict[str, str]:
    """trial_id -> the short name figures and tables show for it (one naming for the whole run)."""
    ids = list(run.trials["trial_id"].astype(str))
    return dict(zip(ids, short_ids(ids), strict=True))


def base_quality(run: Run, quality: str) -> float | None:
    """The unpruned model's quality: KL 0 by definition, others when metadata records `base_<quality>`."""
    if quality in ("kl", "kl_select"):
        return 0.0
    value = run.metadata.get(f"base_{quality}")
    return None if value is None else float(value)


# --------------------------------------------------------------------------- quality against one cost


class ParetoInfo(NamedTuple):
    """One panel: quality against one cost for the search trials of a run.

    points: trial_id, point, cost, quality, feasible, on_front (finished search trials with both values);
    front: the on_front rows sorted by cost (the drawn front line); front_labels: cost, quality,
    label (the front's point names, joined where points coincide); measured: trial_id, point,
    predicted, cost, quality (a `verify` measurement beside each predicted point); baselines: name,
    cost, quality; base: (cost, quality) of the unpruned model, quality None when unknown.
    """

    quality: str
    cost: str
    points: pd.DataFrame
    front: pd.DataFrame
    front_labels: pd.DataFrame
    measured: pd.DataFrame
    baselines: pd.DataFrame
    constraint: Constraint | None
    base: tuple[float, float | None] | None
    base_cost: float | None
    lower_quality_is_better: bool
    lower_cost_is_better: bool


def pareto_info(run: Run, quality: str, cost: str) -> ParetoInfo:
    """Quality against `cost`: feasible front recomputed on this quality (equal to front_<cost> for kl_select)."""
    trials = searched(run.trials)
    trials = trials[trials[quality].notna() & trials[cost].notna()]
    low_q, low_c = lower_is_better(quality), COST_DIRECTIONS[cost] == "min"
    points = pd.DataFrame(
        {
            "trial_id": trials["trial_id"].astype(str).to_numpy(),
            "point": trials["trial_id"].astype(str).map(point_names(run)).to_numpy(),
            "cost": trials[cost].astype(float).to_numpy(),
            "quality": trials[quality].astype(float).to_numpy(),
            "feasible": trials["feasible"].astype(bool).to_numpy(),
        }
    )
    points["on_front"] = False
    feasible = points["feasible"].to_numpy()
    if feasible.any():
        xy = points.loc[feasible, ["quality", "cost"]].to_numpy()
        points.loc[feasible, "on_front"] = pareto_mask(xy, ["min" if low_q else "max", "min" if low_c else "max"])
    front = points[points["on_front"]].sort_values(["cost", "quality"]).reset_index(drop=True)
    base_cost = run.base_costs.get(cost)
    base = None if base_cost is None else (base_cost, base_quality(run, quality))
    return ParetoInfo(
        quality=quality,
        cost=cost,
        points=points,
        front=front,
        front_labels=front.groupby(["cost", "quality"], as_index=False, sort=False).agg(label=("point", ", ".join)),
        measured=_measured(trials, points, quality, cost),
        baselines=_baselines(run.trials, quality, cost),
        constraint=run.constraints.get(cost),
        base=base,
        base_cost=base_cost,
        lower_quality_is_better=low_q,
        lower_cost_is_better=low_c,
    )


def _measured(trials: pd.DataFrame, points: pd.DataFrame, quality: str, cost: str) -> pd.DataFrame:
    col = f"measured_{cost}"
    columns = ["trial_id", "point", "predicted", "cost", "quality"]
    if col not in trials.columns:
        return pd.DataFrame(columns=columns)
    out = points[["trial_id", "point", "cost", "quality"]].rename(columns={"cost": "predicted"})
    out["cost"] = trials[col].astype(float).to_numpy()
    return out[out["cost"].notna()][columns].reset_index(drop=True)


def _baselines(trials: pd.DataFrame, quality: str, cost: str) -> pd.DataFrame:
    if "baseline" not in trials.columns:
        return pd.DataFrame(columns=["name", "cost", "quality"])
    rows = trials[is_baseline(trials)]
    rows = rows[rows[quality].notna() & rows[cost].notna()]
    return pd.DataFrame(
        {
            "name": rows["baseline"].astype(str).to_numpy(),
            "cost": rows[cost].astype(float).to_numpy(),
            "quality": rows[quality].astype(float).to_numpy(),
        }
    )


# --------------------------------------------------------------------------- per-layer architectures


class ArchitectureInfo(NamedTuple):
    """Per-layer shapes of several architectures, one row each.

    kv_heads, ffn: [rows, layers] floats (0 = no-op, NaN where a row has fewer layers);
    max_kv_heads, max_ffn: colour-scale tops (the base model's widths when known).
    """

    labels: list[str]
    hidden: list[int]
    kv_heads: np.ndarray  # [rows, layers]
    ffn: np.ndarray  # [rows, layers]
    max_kv_heads: int
    max_ffn: int


def architecture_info(labels: Sequence[str], architectures: Sequence[str], base: Architecture | None = None) -> ArchitectureInfo:
    """Matrices of KV heads and FFN widths per layer from `architecture` JSON strings."""
    keys = [str(i) for i in range(len(architectures))]
    long = layers(pd.DataFrame({"trial_id": keys, "architecture": list(architectures)}))
    n_layers = int(long["layer"].max()) + 1 if len(long) else 0

    def matrix(col: str) -> np.ndarray:
        wide = long.pivot(index="trial_id", columns="layer", values=col).reindex(index=keys, columns=range(n_layers))
        return wide.to_numpy(dtype=float)

    kv, ffn = matrix("kv_heads"), matrix("ffn")
    hidden = long.groupby("trial_id")["hidden_size"].first().reindex(keys).fillna(0).astype(int).tolist()
    max_kv = base.blocks[0].kv_heads if base else int(np.nanmax(kv, initial=1))
    max_ffn = base.blocks[0].ffn if base else int(np.nanmax(ffn, initial=1))
    return ArchitectureInfo(list(labels), hidden, kv, ffn, max(max_kv, 1), max(max_ffn, 1))


HYBRID_COLUMNS = ("experts", "expert_ffn", "shared_ffn", "mamba_layers", "attention_layers")  # a hybrid-MoE trial's shape


def is_hybrid(run: Run) -> bool:
    """A hybrid-MoE run (GraniteMoeHybrid): global widths and kept layers, no per-layer block configs to draw."""
    known = FAMILIES.get(run.metadata.get("family") or LLAMA)  # the family's seam says whether its trials have layers
    return known is not None and not known.per_layer


def no_architectures() -> ArchitectureInfo:
    return ArchitectureInfo([], [], np.zeros((0, 0)), np.zeros((0, 0)), 1, 1)


def base_architecture(run: Run) -> Architecture | None:
    text = run.metadata.get("base_architecture")
    return Architecture.from_json(text) if text else None


def chosen_points(run: Run, limit: int = 12) -> pd.DataFrame:
    """The joint-front points of a run, best quality first; at most `limit`, spread over the front."""
    pareto = run.pareto.assign(index=np.arange(len(run.pareto)))  # the row `export <run>/pareto.parquet index=N` takes
    front = pareto[pareto["front_all"].astype(bool) & ~is_baseline(pareto)] if len(pareto) else pareto
    later = [c for c in run.trials.columns if c not in front.columns]  # e.g. measured costs written to trials only
    front = front.merge(run.trials[["trial_id", *later]], on="trial_id", how="left") if later else front
    front = front.sort_values(selection_quality(front)).reset_index(drop=True)
    if len(front) > limit:
        front = front.iloc[np.unique(np.linspace(0, len(front) - 1, limit).round().astype(int))].reset_index(drop=True)
    return front


def point_label(row: pd.Series, point: str) -> str:
    return f"{point}: KL {row['kl']:.3g}, {fmt_params(row['params'])}, d={int(row['hidden_size'])}"


def run_architectures(run: Run, limit: int = 12) -> ArchitectureInfo:
    """The run's chosen points (and the base model when metadata records it) layer by layer (none for a hybrid-MoE run)."""
    if is_hybrid(run):
        return no_architectures()
    front = chosen_points(run, limit)
    names = point_names(run)
    labels = [point_label(row, names.get(str(row["trial_id"]), str(row["trial_id"]))) for _, row in front.iterrows()]
    archs = list(front["architecture"].astype(str))
    base = base_architecture(run)
    if base is not None:
        labels.insert(0, f"base model, {fmt_params(base.num_params())}, d={base.hidden_size}")
        archs.insert(0, base.to_json())
    return architecture_info(labels, archs, base)


def best_point(run: Run) -> pd.Series | None:
    """The chosen architecture of a run: the feasible search trial with the lowest selection-split KL (its `kl` is reported)."""
    ok = searched(run.trials)
    key = selection_quality(ok)
    ok = ok[ok["feasible"].astype(bool) & ok[key].notna()]
    return None if ok.empty else ok.sort_values(key).iloc[0]


def compare_architectures(runs: Sequence[Run]) -> ArchitectureInfo:
    """The chosen architecture of every run side by side (runs without a feasible trial are left out)."""
    labels, archs = [], []
    for run in runs:
        best = best_point(run)
        if best is not None and not is_hybrid(run):
            labels.append(f"{run.label}: KL {best['kl']:.3g}, {fmt_params(best['params'])}, d={int(best['hidden_size'])}")
            archs.append(str(best["architecture"]))
    return architecture_info(labels, archs)


# --------------------------------------------------------------------------- tables and their text


def fmt_params(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.0f}k"


def fmt_number(v: float) -> str:
    """60k for large values, four significant digits otherwise."""
    return f"{v / 1000:,.4g}k" if abs(v) >= 10_000 else f"{v:.4g}"


def cost_name(cost: str) -> str:
    return COST_LABELS.get(cost, cost).split(" (")[0]


def cost_unit(cost: str) -> str:
    label = COST_LABELS.get(cost, "")
    return label.split(" (")[1].rstrip(")") if " (" in label else ""


def pareto_table(run: Run) -> pd.DataFrame:
    """The run's joint-front points, best quality first: the key table of a report."""
    front = chosen_points(run, limit=len(run.pareto) or 1)
    extra = [c for c in quality_metrics(run.trials) if c != "kl" and c in front.columns]
    measured = [f"measured_{c}" for c in COST_DIRECTIONS if f"measured_{c}" in front.columns]
    if is_hybrid(run):
        cols = ["trial_id", "margin", "params", *HYBRID_COLUMNS, "kl", *extra]
    else:
        cols = ["trial_id", "margin", "dual_lr", "params", "hidden_size", "num_attention_kept", "num_ffn_kept", "kl", *extra]
    table = front[["index", *cols, *COST_DIRECTIONS, *measured]].copy()
    names = point_names(run)
    table.insert(0, "point", [names.get(str(t), str(t)) for t in table["trial_id"]])
    if "architecture" in front.columns:  # two trials that found the same shape: the later rows name the first
        first = front.groupby("architecture", sort=False)["trial_id"].transform("first").astype(str)
        table["same_as"] = [names.get(f, f) if f != str(t) else "" for f, t in zip(first, front["trial_id"], strict=True)]
    return table.reset_index(drop=True)


def summary_table(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per run: counts and the chosen point's quality and costs relative to the base model."""
    rows = []
    for run in runs:
        ok = searched(run.trials)
        best = best_point(run)
        row: dict[str, object] = {
            "run": run.label,
            "hardware": run.spec.scenario.hardware.name if run.spec else "",
            "trials": int((~is_baseline(run.trials)).sum()),
            "finished": len(ok),
            "feasible": int(ok["feasible"].astype(bool).sum()),
            "on_front": int((~is_baseline(run.pareto)).sum()),  # on at least one front, as in pareto.parquet
            "best_kl": math.nan if best is None else float(best["kl"]),
            "params_share": math.nan if best is None else float(best["params"]) / float(run.metadata.get("base_params") or math.nan),
        }
        for cost in COST_DIRECTIONS:
            base = run.base_costs.get(cost)
            row[f"{cost}_share"] = math.nan if best is None or not base else float(best[cost]) / base
        rows.append(row)
    return pd.DataFrame(rows)
