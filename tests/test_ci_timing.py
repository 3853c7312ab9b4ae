"""benchmarks/ci_timing.py reads the counts and seconds of both pytest runs from a CI log, as pytest prints them."""

from __future__ import annotations

from .conftest import load_benchmark

LOG = """
bringing up nodes...
........................................................................ [ 99%]
2 failed, 801 passed, 3 skipped in 768.52s (0:12:48)
.venv/bin/python -m pytest -m timing
======================== 6 passed, 803 deselected in 91.20s (0:01:31) =========================
ruff check autocompress tests benchmarks
All checks passed!
"""


def test_the_ci_log_gives_each_pytest_runs_counts_and_seconds() -> None:
    runs = load_benchmark("ci_timing").pytest_runs(LOG)
    assert runs == [
        {"failed": 2, "passed": 801, "skipped": 3, "seconds": 768.52},
        {"passed": 6, "deselected": 803, "seconds": 91.2},
    ]
