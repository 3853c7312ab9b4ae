"""The bootstrap over timed waves: the noise of a median, and how far a held-out MAPE moves with it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from autocompress.cost.waves import mape_interval, median_noise, median_noise_summary


def rows(waves: list[list[float]]) -> pd.DataFrame:
    return pd.DataFrame(
        {"ttft_waves_ms": waves, "tpot_waves_ms": waves, "throughput_waves": waves, "ttft_ms": [float(np.median(w)) for w in waves]}
    )


def test_identical_waves_have_no_noise_and_jitter_has_some() -> None:
    assert median_noise([10.0] * 7) == 0.0
    jitter = median_noise([9.0, 10.0, 11.0, 10.5, 9.5, 12.0, 8.0])
    assert 0.02 < jitter < 0.2


def test_more_waves_of_the_same_engine_pin_the_median_down() -> None:
    rng = np.random.default_rng(1)
    few = [median_noise(list(rng.normal(10, 1, 5)), seed=s) for s in range(20)]
    many = [median_noise(list(rng.normal(10, 1, 80)), seed=s) for s in range(20)]
    assert np.median(many) < 0.5 * np.median(few)


def test_mape_interval_covers_the_true_error_and_measures_its_noise() -> None:
    """A model 20 % above every median: the interval sits around 20 %; noisy waves widen it, quiet ones do not."""
    rng = np.random.default_rng(0)
    noisy = [list(rng.normal(m, 0.1 * m, 7)) for m in (10.0, 20.0, 40.0, 80.0)]
    quiet = [[m * (1 + 1e-4 * k) for k in range(7)] for m in (10.0, 20.0, 40.0, 80.0)]
    for waves, width in ((noisy, 1.0), (quiet, 0.1)):
        pred = [{k: 1.2 * float(np.median(w)) for k in ("ttft_ms", "tpot_ms", "throughput_tok_s")} for w in waves]
        lo, hi = mape_interval(pred, rows(waves))["tpot_ms"]
        assert lo <= 20.0 + 0.05 and hi >= 20.0 - 0.05
        assert (hi - lo > width) if width >= 1 else (hi - lo < width)


def test_rows_without_waves_are_left_out_not_guessed() -> None:
    """Measurements from before waves were kept: no noise figure rather than a made-up one."""
    old = pd.DataFrame({"ttft_ms": [10.0, 12.0]})
    assert median_noise_summary(old) == {} and mape_interval([{"ttft_ms": 10.0}] * 2, old) == {}
    mixed = rows([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]])
    mixed.at[1, "tpot_waves_ms"] = None
    summary = median_noise_summary(mixed)
    assert summary["tpot_ms"]["n"] == 1 and summary["ttft_ms"]["n"] == 2 and summary["ttft_ms"]["waves"] == 3
    pred = [{k: 2.0 for k in ("ttft_ms", "tpot_ms", "throughput_tok_s")}] * 2
    assert "tpot_ms" not in mape_interval(pred, mixed) and "ttft_ms" in mape_interval(pred, mixed)
    assert median_noise([1.0, 2.0, 3.0]) == pytest.approx(summary["ttft_ms"]["max"])
