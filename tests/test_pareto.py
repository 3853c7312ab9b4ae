"""Pareto fronts on hand-made points."""

from __future__ import annotations

import numpy as np
import pandas as pd

from autocompress.results.pareto import pareto_frame, pareto_mask


def test_pareto_mask_min_min() -> None:
    pts = np.array([[1, 5], [2, 3], [3, 4], [4, 1], [2, 3]])
    # (3, 4) is dominated by (2, 3); the duplicate (2, 3) rows do not dominate each other
    assert pareto_mask(pts, ["min", "min"]).tolist() == [True, True, False, True, True]


def test_pareto_mask_min_max() -> None:
    pts = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 15.0]])  # quality (min) vs throughput (max)
    assert pareto_mask(pts, ["min", "max"]).tolist() == [True, True, False]


def test_pareto_frame_keeps_only_feasible_finished_fronts() -> None:
    trials = pd.DataFrame(
        {
            "trial_id": list("abcde"),
            "status": ["ok", "ok", "ok", "error", "ok"],
            "feasible": [True, True, False, False, True],
            "kl_select": [0.1, 0.2, 0.05, np.nan, 0.3],
            "kl": [0.25, 0.1, 0.0, np.nan, 0.05],  # the report split: on it, e would beat a and b; fronts must not use it
            "ttft_ms": [10, 8, 1, np.nan, 9],
            "tpot_ms": [1, 1, 1, np.nan, 1],
            "throughput_tok_s": [100, 100, 500, np.nan, 100],
            "memory_gib": [1, 1, 1, np.nan, 1],
        }
    )
    front = pareto_frame(trials)
    assert front["trial_id"].tolist() == ["a", "b"]  # c infeasible, d failed, e dominated by b (on kl_select)
    assert front["front_ttft_ms"].tolist() == [True, True]
    assert not front["front_tpot_ms"].iloc[1]  # on TPOT alone, b (0.2) is beaten by a (0.1)
    assert pareto_frame(trials.assign(feasible=False)).empty
