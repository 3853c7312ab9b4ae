"""Drawing of the report figures from the data in `figures.py` (matplotlib, Agg, no pyplot state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autocompress.charts.figures import COST_LABELS, ArchitectureInfo, ParetoInfo, cost_name, cost_unit, fmt_number, quality_label
from autocompress.io import atomic_write

NOOP_COLOR = "#d0d0d0"
COLORS = {"infeasible": "#9e9e9e", "feasible": "#4c72b0", "front": "#c44e52", "measured": "#2a9d3f", "base": "black", "baseline": "#8c4fb0"}
OPS = {"max": "≤", "min": "≥"}


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # matplotlib only when a report is drawn

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def save(fig: Any, path: Path) -> Path:
    """Write `fig` as PNG to `path` atomically (temp name in the same folder, then rename)."""
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))


# --------------------------------------------------------------------------- quality against each cost


def plot_pareto(infos: Sequence[ParetoInfo], title: str) -> Any:
    """A grid of panels, one per cost; a single legend below them."""
    cols = 2 if len(infos) > 1 else 1
    rows = -(-len(infos) // cols)
    fig = _figure(6.2 * cols, 4.6 * rows + 0.9)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, info in zip(axes, infos, strict=False):
        handles.update(_draw_pareto(ax, info))
    for ax in axes[len(infos) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=13)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=min(len(handles), 4), fontsize=9, frameon=False)
    return fig


def _draw_pareto(ax: Any, info: ParetoInfo) -> dict[str, Any]:
    """One panel; returns legend label -> handle."""
    h: dict[str, Any] = {}
    pts = info.points
    infeasible, feasible = pts[~pts["feasible"]], pts[pts["feasible"] & ~pts["on_front"]]
    if len(infeasible):
        h["infeasible trial"] = ax.scatter(infeasible["cost"], infeasible["quality"], s=28, c=COLORS["infeasible"], alpha=0.55, zorder=2)
    if len(feasible):
        h["feasible trial"] = ax.scatter(feasible["cost"], feasible["quality"], s=30, c=COLORS["feasible"], alpha=0.8, zorder=3)
    if len(info.front):
        ax.plot(info.front["cost"], info.front["quality"], "--", color=COLORS["front"], lw=1.2, zorder=3)
        h["Pareto front (feasible)"] = ax.scatter(info.front["cost"], info.front["quality"], s=42, c=COLORS["front"], zorder=4)
    h.update(_draw_references(ax, info))
    if pts.empty:
        ax.text(0.5, 0.5, "no finished trials", transform=ax.transAxes, ha="center", va="center", color="grey")
    xlim = _xlim(info)
    if xlim is not None:
        ax.set_xlim(*xlim)
    _label_front(ax, info)
    if info.constraint is not None:
        h.update(_draw_constraint(ax, info))
    _label_axes(ax, info)
    return h


def _label_front(ax: Any, info: ParetoInfo) -> None:
    """Point names beside the front's points, on their left near the right edge so that they stay inside."""
    lo, hi = ax.get_xlim()
    falling = info.lower_cost_is_better == info.lower_quality_is_better  # the front runs from upper left to lower right
    for _, p in info.front_labels.iterrows():
        right_edge = hi > lo and (p["cost"] - lo) / (hi - lo) > 0.85
        above = falling != right_edge  # the side of the point away from the front line
        offset, ha = ((-5 if right_edge else 5), 4 if above else -10), ("right" if right_edge else "left")
        ax.annotate(
            p["label"], (p["cost"], p["quality"]), xytext=offset, textcoords="offset points", ha=ha, fontsize=7, color=COLORS["front"]
        )


def _draw_references(ax: Any, info: ParetoInfo) -> dict[str, Any]:
    """Measured points beside predicted ones, baseline architectures, the unpruned model."""
    h: dict[str, Any] = {}
    m = info.measured
    if len(m):
        for _, r in m.iterrows():
            ax.plot([r["predicted"], r["cost"]], [r["quality"], r["quality"]], "-", color=COLORS["measured"], lw=0.8, alpha=0.7, zorder=2)
        h["measured (verify)"] = ax.scatter(
            m["cost"], m["quality"], s=40, marker="D", facecolors="none", edgecolors=COLORS["measured"], zorder=5
        )
    for _, b in info.baselines.iterrows():
        h["baseline"] = ax.scatter([b["cost"]], [b["quality"]], s=120, marker="*", c=COLORS["baseline"], zorder=6)
        ax.annotate(b["name"], (b["cost"], b["quality"]), xytext=(5, -10), textcoords="offset points", fontsize=8, color=COLORS["baseline"])
    if info.base is not None and info.base[1] is not None:
        h["base model (unpruned)"] = ax.scatter([info.base[0]], [info.base[1]], s=70, marker="X", c=COLORS["base"], zorder=6)
    elif info.base_cost is not None:
        h["base model cost"] = ax.axvline(info.base_cost, color=COLORS["base"], ls=":", lw=1)
    return h


def _draw_constraint(ax: Any, info: ParetoInfo) -> dict[str, Any]:
    """The bound as a vertical line; the side that violates it shaded (call after the limits are set)."""
    c = info.constraint
    assert c is not None
    lo, hi = ax.get_xlim()
    line = ax.axvline(c.value, color=COLORS["front"], lw=1.3)
    side = (c.value, hi) if c.sense == "max" else (lo, c.value)
    span = ax.axvspan(*side, color=COLORS["front"], alpha=0.1, lw=0)
    ax.set_xlim(lo, hi)
    return {"constraint bound": line, "violates the bound": span}


def _xlim(info: ParetoInfo) -> tuple[float, float] | None:
    """x range holding every point, measurement, baseline, the base model's cost and the bound, padded 5%."""
    xs = [*info.points["cost"], *info.measured["cost"], *info.baselines["cost"]]
    xs += [v for v in (info.base_cost, info.constraint.value if info.constraint else None) if v is not None]
    if not xs:
        return None
    lo, hi = min(xs), max(xs)
    pad = 0.05 * (hi - lo) if hi > lo else 0.05 * abs(hi) or 1.0
    return lo - pad, hi + pad


def _title(info: ParetoInfo) -> str:
    name = cost_name(info.cost)
    vertical = "lower" if info.lower_quality_is_better else "upper"
    horizontal = "left" if info.lower_cost_is_better else "right"
    title = f"{name} (better: {vertical} {horizontal})"
    c = info.constraint
    if c is not None:
        share = f" = {c.value / info.base_cost:.2f}× base" if info.base_cost else ""
        title += f"\nconstraint {OPS[c.sense]} {fmt_number(c.value)} {cost_unit(info.cost)}{share}"
    return title


def log_quality_axis(info: ParetoInfo) -> bool:
    """Perplexity on a log axis when its values (the unpruned model's marker included) span more than 20x: a linear axis
    flattens the base model's ~12 against pruned models' ~1,000."""
    q = [float(v) for v in info.points["quality"]]
    if info.base is not None and info.base[1] is not None:
        q.append(float(info.base[1]))
    return info.quality == "perplexity" and bool(q) and min(q) > 0 and max(q) / min(q) > 20


def _label_axes(ax: Any, info: ParetoInfo) -> None:
    from matplotlib.ticker import FuncFormatter, ScalarFormatter

    ax.set_xlabel(COST_LABELS.get(info.cost, info.cost))
    ax.set_ylabel(quality_label(info.quality))
    ax.set_title(_title(info), fontsize=10)
    if log_quality_axis(info):
        ax.set_yscale("log")
    if max(abs(x) for x in ax.get_xlim()) >= 10_000:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_number(v)))
    else:
        ax.xaxis.set_major_formatter(ScalarFormatter(useOffset=False))
    ax.grid(alpha=0.25)


# --------------------------------------------------------------------------- per-layer architectures


def plot_architectures(info: ArchitectureInfo, title: str) -> Any:
    """Two heatmaps, rows = architectures, columns = layers: KV heads on top, FFN width below."""
    n_rows, n_layers = info.kv_heads.shape
    cell_w = 0.36 if n_layers <= 40 else 0.2
    label_w = 0.065 * max((len(s) for s in info.labels), default=10) + 0.6
    fig = _figure(max(8.0, label_w + cell_w * n_layers + 1.6), 2 * (0.32 * n_rows + 0.9) + 1.0)
    ax_att, ax_ffn = fig.subplots(2, 1)
    annotate = n_layers <= 40 and n_rows <= 16
    _heatmap(ax_att, info.kv_heads, info.labels, info.max_kv_heads, "KV heads", annotate, discrete=True)
    _heatmap(ax_ffn, info.ffn, info.labels, info.max_ffn, "FFN intermediate size", annotate, discrete=False)
    ax_att.set_title("attention: KV heads kept per layer (grey = no-op attention)", fontsize=10)
    ax_ffn.set_title("FFN: intermediate size per layer (grey = no-op FFN)", fontsize=10)
    ax_ffn.set_xlabel("layer")
    fig.suptitle(title, fontsize=12)
    return fig


def _colours(vmax: int, discrete: bool) -> tuple[Any, Any]:
    """(colormap, norm): one shade of blue per KV-head count, or viridis over (0, vmax] for widths."""
    from matplotlib import colormaps
    from matplotlib.colors import BoundaryNorm, ListedColormap, Normalize

    if discrete:
        cmap = ListedColormap(colormaps["Blues"](np.linspace(0.35, 0.95, vmax)))
        return cmap, BoundaryNorm(np.arange(0.5, vmax + 1.5), cmap.N)
    return colormaps["viridis"].copy(), Normalize(0, vmax)


def _heatmap(ax: Any, values: np.ndarray, labels: Sequence[str], vmax: int, bar: str, annotate: bool, discrete: bool) -> None:
    """Kept widths coloured; no-op cells grey; missing layers (shorter models) blank."""
    from matplotlib.colors import ListedColormap

    cmap, norm = _colours(vmax, discrete)
    cmap = cmap.with_extremes(bad="white")
    kept = np.ma.masked_where(~(values > 0), values)
    im = ax.imshow(kept, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    noop = np.ma.masked_where(values != 0, np.zeros_like(values))
    ax.imshow(noop, cmap=ListedColormap([NOOP_COLOR]), aspect="auto", interpolation="nearest")
    cbar = ax.figure.colorbar(im, ax=ax, label=bar, pad=0.01, fraction=0.03)
    if discrete:
        cbar.set_ticks(range(1, vmax + 1))
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    n_layers = values.shape[1]
    step = 1 if n_layers <= 40 else 2
    ax.set_xticks(range(0, n_layers, step), [str(i) for i in range(0, n_layers, step)], fontsize=7)
    ax.set_xticks(np.arange(-0.5, n_layers, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, len(labels), 1), minor=True)
    ax.grid(which="minor", color="white", lw=0.8)
    ax.tick_params(which="minor", length=0)
    if annotate:
        for (i, j), v in np.ndenumerate(values):
            if v > 0:
                r, g, b, _ = cmap(norm(v))
                dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6, color="white" if dark else "black")
