"""The GPU cost-model fits shipped in the package (issue 14 items 1-2), from aiconfigurator-core's estimates.

For each GPU hardware file, `python -m autocompress.profile profile.source=aiconfigurator` over the
design of experiments (base, smallest, uniform shrinks, N random heterogeneous architectures, a
third of them held out) on every GPU workload; the fit is copied to autocompress/cost/fits/ (what
`cost_model=auto` uses on a fresh clone), the estimates to benchmarks/results/aiconfigurator/, and
the held-out validation is printed as Markdown and saved as validation.json. No GPU is used: the
figures are aiconfigurator's kernel-table estimates (vLLM 0.24.0), not serving measurements.

    .venv/bin/python benchmarks/aiconfigurator_fits.py                 # all five GPUs, 48 random architectures each
    .venv/bin/python benchmarks/aiconfigurator_fits.py --hardware h100_sxm --n-random 12
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import common  # checks that the autocompress imported is this tree's

ROOT = Path(__file__).resolve().parents[1]
FITS = ROOT / "autocompress" / "cost" / "fits"
OUT = ROOT / "benchmarks" / "results" / "aiconfigurator"
WORKLOADS = ["batched_serving", "long_context_coding", "interactive_game"]
# hardware -> the scenario that composes it (its own workload is fitted too)
HARDWARE = {
    "h100_sxm": ["+scenario=h100_batched"],
    "h200": ["+scenario=h100_batched", "hardware=h200"],
    "b200": ["+scenario=b200_longctx"],
    "rtx5070": ["+scenario=rtx5070_coding"],
    "rtx5080": ["+scenario=rtx5080_game"],
}
SCENARIO_WORKLOAD = {
    "h100_sxm": "batched_serving",
    "h200": "batched_serving",
    "b200": None,
    "rtx5070": "long_context_coding",
    "rtx5080": "interactive_game",
}


def fit(hardware: str, n_random: int, tmp: Path) -> dict:
    extra = [w for w in WORKLOADS if w != SCENARIO_WORKLOAD[hardware]]
    cmd = [
        sys.executable, "-m", "autocompress.profile", *HARDWARE[hardware], "profile.source=aiconfigurator",
        f"profile.n_random={n_random}", f"profile.extra_workloads=[{','.join(extra)}]", f"results.dir={tmp}",
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stderr=subprocess.DEVNULL)
    (path,) = (tmp / "cost_models").glob(f"{hardware}__vllm__v*.json")
    record = json.loads(path.read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    estimates = OUT / f"{hardware}.parquet"
    shutil.copy(record["measurements"], estimates)
    record["measurements"] = str(estimates.relative_to(ROOT))
    record["version"] = 1
    FITS.mkdir(parents=True, exist_ok=True)
    (FITS / f"{hardware}__vllm__v1.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", nargs="*", default=list(HARDWARE), choices=list(HARDWARE))
    ap.add_argument("--n-random", type=int, default=48)
    args = ap.parse_args()
    record_run = common.Record()
    summary = {}
    for hw in args.hardware:
        with tempfile.TemporaryDirectory() as tmp:
            record = fit(hw, args.n_random, Path(tmp))
        summary[hw] = {
            k: record[k] for k in ("source", "derived_from", "n_fit", "n_holdout", "validation", "validation_analytic", "parameters")
        }
    for hw in summary:  # each hardware's entry says which run made it (the file keeps the other hardware's entries)
        summary[hw]["_record"] = record_run.as_dict()
    path = OUT / "validation.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **summary}, indent=2) + "\n")
    print("\n| hardware | estimates of | metric | MAPE % | max % | Spearman | prior-only MAPE % |\n|---|---|---|---|---|---|---|")
    for hw, s in summary.items():
        of = s["derived_from"] or s["source"].rsplit(", ", 1)[1]
        for metric, v in s["validation"].items():
            before = s["validation_analytic"][metric]["mape"]
            print(f"| {hw} | {of} | {metric} | {v['mape']:.2f} | {v['max_error']:.2f} | {v['spearman']:.3f} | {before:.1f} |")


if __name__ == "__main__":
    main()
