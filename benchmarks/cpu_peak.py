"""Peak fp32 matmul throughput and copy bandwidth of this machine (the `cpu` hardware config's numbers).

.venv/bin/python benchmarks/cpu_peak.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import common  # noqa: F401  (checks that the autocompress imported is this tree's)
import torch


def matmul_gflops(n: int = 1024, repeats: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def copy_gbs(mib: int = 512, repeats: int = 5) -> float:
    x = torch.randn(mib * 1024 * 1024 // 4)
    y = torch.empty_like(x)
    for _ in range(2):
        y.copy_(x)
    start = time.perf_counter()
    for _ in range(repeats):
        y.copy_(x)
    return 2 * x.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9  # read + write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps({"threads": args.threads, "fp32_matmul_gflops": round(matmul_gflops(), 1), "copy_gbs": round(copy_gbs(), 1)}))


if __name__ == "__main__":
    main()
