"""The noise of a measured median, by bootstrap over the engine's timed waves.

Each engine row keeps every timed wave (cost/engine.py, WAVE_FIELDS). Resampling the waves of a
row with replacement and taking the median again shows how far that row's median could move with
other waves of the same engine; doing it for every held-out row at once shows how far the
held-out MAPE moves from measurement noise alone, so a validation error can be read beside it.
Rows measured before waves were kept have none and are left out of these figures.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from autocompress.cost.engine import WAVE_FIELDS

DRAWS = 2000
LEVEL = 90  # % interval


def _waves(row: pd.Series, metric: str) -> np.ndarray | None:
    field = WAVE_FIELDS[metric]
    values = row.get(field) if field in row else None
    if values is None or (isinstance(values, float) and np.isnan(values)):
        return None
    waves = np.asarray(values, dtype=float)
    return waves if waves.size >= 2 and np.all(waves > 0) else None


def _resampled_medians(waves: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.median(rng.choice(waves, size=(DRAWS, waves.size), replace=True), axis=1)


def median_noise(waves: Sequence[float] | np.ndarray, seed: int = 0) -> float:
    """Half the width of the 90 % bootstrap interval of the median of `waves`, relative to that median."""
    w = np.asarray(waves, dtype=float)
    lo, hi = np.percentile(_resampled_medians(w, np.random.default_rng(seed)), [(100 - LEVEL) / 2, (100 + LEVEL) / 2])
    return float((hi - lo) / 2 / np.median(w))


def median_noise_summary(rows: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per metric, over the rows that kept their waves: the median and the largest noise of a median, and the waves per row."""
    out: dict[str, dict[str, float]] = {}
    for metric in WAVE_FIELDS:
        found = [w for _, r in rows.iterrows() if (w := _waves(r, metric)) is not None]
        if found:
            noise = [median_noise(w) for w in found]
            waves = int(np.median([w.size for w in found]))
            out[metric] = {"median": float(np.median(noise)), "max": float(np.max(noise)), "waves": waves, "n": len(found)}
    return out


def mape_interval(predicted: Sequence[dict[str, float]], rows: pd.DataFrame, seed: int = 0) -> dict[str, list[float]]:
    """Per metric: the 90 % interval of the held-out MAPE (%) over bootstrap draws of every row's waves.

    `predicted[i]` is the model's prediction for `rows.iloc[i]`; the predictions stay fixed, only
    the measured medians are redrawn. Metrics where some row has no waves are left out.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, list[float]] = {}
    for metric in WAVE_FIELDS:
        waves = [_waves(r, metric) for _, r in rows.iterrows()]
        if not waves or any(w is None for w in waves):
            continue
        pred = np.array([p[metric] for p in predicted], dtype=float)
        measured = np.stack([_resampled_medians(w, rng) for w in waves if w is not None], axis=1)  # [draws, rows]
        mape = (np.abs(pred[None, :] - measured) / measured).mean(axis=1) * 100
        lo, hi = np.percentile(mape, [(100 - LEVEL) / 2, (100 + LEVEL) / 2])
        out[metric] = [float(lo), float(hi)]
    return out
