"""Which CPU this is: identity, dtype and measured peaks per CPU (machines of one kind differ several-fold)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autocompress.config import cpuinfo
from autocompress.config.compose import compose_spec

AVX2 = {"model": "AMD EPYC", "simd": "avx2", "cores": "2"}
BF16 = {"model": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "simd": "avx2 avx512f avx512_bf16 amx_bf16", "cores": "2"}


def test_key_and_dtype_follow_the_cpu() -> None:
    assert cpuinfo.key(AVX2) == "amd-epyc__avx2__2c"
    assert cpuinfo.key(BF16) == "intel-r-xeon-r-platinum-8481c-cpu-2-70ghz__avx2-avx512f-avx512_bf16-amx_bf16__2c"
    assert cpuinfo.auto_dtype(AVX2) == "fp32" and cpuinfo.auto_dtype(BF16) == "bf16"
    assert cpuinfo.auto_dtype({**AVX2, "simd": "avx2 avx512f"}) == "fp32"  # AVX-512 without BF16: oneDNN has no bf16 matmul
    here = cpuinfo.identity()
    assert here["model"] and here["cores"].isdigit() and set(here["simd"].split()) <= set(cpuinfo.SIMD)


def test_cpu_scenarios_take_this_cpus_identity_dtype_and_measured_peaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cpu hardware file's peaks are measured once per CPU (cached), and replace the file's; GPU scenarios are untouched."""
    monkeypatch.setenv("AUTOCOMPRESS_CACHE", str(tmp_path))
    calls: list[str] = []

    def fake(dtype: str = "fp32") -> dict[str, float]:
        calls.append(dtype)
        return {"peak_tflops": 0.5, "mem_bandwidth_gbs": 50.0}

    monkeypatch.setattr(cpuinfo, "measure", fake)
    for _ in range(2):
        scenario = compose_spec("+scenario=cpu_interactive").scenario
        assert scenario.hardware.cpu == cpuinfo.key() and scenario.workload.dtype == cpuinfo.auto_dtype()
        assert (scenario.hardware.peak_tflops, scenario.hardware.mem_bandwidth_gbs) == (0.5, 50.0)
    assert calls == [cpuinfo.auto_dtype()]  # the second scenario read the cache
    cached = json.loads((tmp_path / "cpu" / f"{cpuinfo.key()}.json").read_text())
    assert cached[cpuinfo.auto_dtype()]["cpu"] == cpuinfo.identity()
    fixed = compose_spec("+scenario=cpu_interactive", "hardware.measure_peaks=false").scenario.hardware
    assert (fixed.peak_tflops, fixed.mem_bandwidth_gbs, fixed.cpu) == (0.122, 24.0, cpuinfo.key())
    gpu = compose_spec("+scenario=h100_batched").scenario
    assert gpu.hardware.cpu is None and gpu.workload.dtype == "bf16"


def test_measured_peaks_are_plausible() -> None:
    """The real measurement: positive and finite (what it reads depends on the CPU and its load)."""
    out = cpuinfo.measure("fp32", n=256, repeats=2, mib=16, rounds=2)
    assert 0 < out["peak_tflops"] < 100 and 0 < out["mem_bandwidth_gbs"] < 10_000


def test_peaks_measured_on_a_busy_machine_are_flagged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The load beside the measurement is recorded; a busy one is warned about when the peaks are used, a quiet one is not."""
    monkeypatch.setenv("AUTOCOMPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(cpuinfo, "measure", lambda dtype="fp32": {"peak_tflops": 0.3, "mem_bandwidth_gbs": 13.0})
    monkeypatch.setattr(cpuinfo.os, "cpu_count", lambda: 2)
    cpuinfo._warn_busy.cache_clear()
    monkeypatch.setattr(cpuinfo.os, "getloadavg", lambda: (3.2, 3.0, 2.0))  # a test suite's two workers beside this process
    first = cpuinfo.peaks("fp32")
    assert first["other_load_per_core"] == 1.1 and "measured" in capsys.readouterr().err
    monkeypatch.setattr(cpuinfo.os, "getloadavg", lambda: (0.9, 0.5, 0.5))  # quiet now: the cached entry is still the busy one
    assert cpuinfo.peaks("fp32")["peak_tflops"] == 0.3
    cpuinfo._warn_busy.cache_clear()
    cpuinfo.peaks("fp32")
    assert "while other work ran (1.10 per core" in capsys.readouterr().err
    second = cpuinfo.peaks("bf16")  # measured now, on the quiet machine: no warning
    assert second["other_load_per_core"] == 0.0 and capsys.readouterr().err == ""
