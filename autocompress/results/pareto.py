"""Pareto fronts in pure numpy: which trials no other trial beats on quality and cost together."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from autocompress.config.metrics import METRICS

QUALITY = "kl_select"  # selection-split KL to the teacher (lower is better); `kl` (report split) is what is reported
# which way each cost is better, from the one metric table: an upper-bounded ("max") cost is minimised
COST_DIRECTIONS: dict[str, str] = {metric: "min" if sense == "max" else "max" for metric, sense in METRICS.items()}


def pareto_mask(points: np.ndarray, directions: Sequence[str]) -> np.ndarray:
    """Boolean mask of the non-dominated rows of `points` [n, k] ("min" or "max" per column).

    Row a dominates row b when a is at least as good in every column and better in one.
    Identical rows do not dominate each other (both stay).
    """
    signs = np.array([1.0 if d == "min" else -1.0 for d in directions])
    x = np.asarray(points, dtype=float) * signs  # now every column is minimised
    n = len(x)
    keep = np.ones(n, dtype=bool)
    for i in range(n):
        better_eq = np.all(x <= x[i], axis=1)
        strictly = np.any(x < x[i], axis=1)
        keep[i] = not np.any(better_eq & strictly)
    return keep


def pareto_frame(trials: pd.DataFrame) -> pd.DataFrame:
    """Feasible trials on at least one front: quality vs each cost, and quality vs all costs jointly.

    Adds boolean columns `front_<cost>` (2-D front of quality vs that cost) and `front_all`.
    """
    ok = trials[(trials["status"] == "ok") & trials["feasible"].astype(bool)].copy()
    if ok.empty:
        return ok.assign(**{f"front_{c}": pd.Series(dtype=bool) for c in [*COST_DIRECTIONS, "all"]})
    for cost, direction in COST_DIRECTIONS.items():
        ok[f"front_{cost}"] = pareto_mask(ok[[QUALITY, cost]].to_numpy(), ["min", direction])
    ok["front_all"] = pareto_mask(ok[[QUALITY, *COST_DIRECTIONS]].to_numpy(), ["min", *COST_DIRECTIONS.values()])
    on_any = ok[[f"front_{c}" for c in [*COST_DIRECTIONS, "all"]]].any(axis=1)
    return ok[on_any].sort_values(QUALITY).reset_index(drop=True)
