"""Per-workload held-out error of a fitted cost model, and every measurement's residual and noise.

`python -m autocompress.profile` prints the validation over all held-out measurements; this splits it
by workload and lists, per measured (architecture, workload), measured vs predicted TTFT and TPOT
with the measurement's own run-to-run spread, so that model error and engine noise can be told apart.

    .venv/bin/python benchmarks/cost_model_residuals.py +scenario=cpu_interactive
    .venv/bin/python benchmarks/cost_model_residuals.py +scenario=cpu_interactive --model results/cost_models/cpu__vllm-cpu__v1.json
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import common  # noqa: F401  (checks that the autocompress imported is this tree's)
import numpy as np

from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.compose import compose_spec, load_workload
from autocompress.cost.analytic import AnalyticCostModel
from autocompress.cost.design import load_measurements, measurements_path, to_measurements
from autocompress.cost.fitted import FITTED, latest_record, load_record, validate
from autocompress.model.base import load_base_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a fitted cost-model JSON; default: the newest for the hardware")
    parser.add_argument("overrides", nargs="+", help="Hydra overrides, e.g. +scenario=cpu_interactive")
    args = parser.parse_args()
    spec = compose_spec(*args.overrides)
    hw = spec.scenario.hardware
    record = load_record(args.model) if args.model else latest_record(spec.results_dir, hw.name, hw.engine)
    if record is None:
        raise SystemExit(f"no fitted cost model for {hw.name}/{hw.engine}: run python -m autocompress.profile first")
    base = Architecture.from_llama_config(load_base_model(spec.model).model.config)
    space = SearchSpace.from_base(base, spec.search.space)
    fitted = dataclasses.replace(hw, **{k: record["parameters"][k] for k in FITTED})
    table = load_measurements(measurements_path(spec.results_dir, hw))
    table = table[table["status"] == "ok"]
    workloads = {w["name"]: load_workload(w["name"]) for w in record["workloads"]}

    print(f"cost model v{record['version']} ({record['created']}), {len(table)} measurements\n")
    print("| workload | metric | held-out MAPE % | max % | Spearman | median run-to-run spread % |")
    print("|---|---|---|---|---|---|")
    for name in workloads:
        held = to_measurements(table[table["workload"] == name], "holdout", workloads)
        spreads = table[(table["workload"] == name) & (table["role"] == "holdout")]
        for metric, v in validate(space, fitted, held).items():
            column = metric.replace("_ms", "").replace("_tok_s", "") + "_spread"
            noise = f"{100 * float(np.median(spreads[column])):.1f}" if column in spreads else "-"
            print(f"| {name} | {metric} | {v['mape']:.1f} | {v['max_error']:.1f} | {v['spearman']:.2f} | {noise} |")

    print("\n| role | workload | params (M) | TTFT meas / pred ms | TPOT meas / pred ms | TPOT spread % |")
    print("|---|---|---|---|---|---|")
    for row in table.itertuples():
        (m,) = to_measurements(table[table.index == row.Index], row.role, workloads)
        pred = AnalyticCostModel(space, fitted, m.workload).predict(m.arch)
        ttft, tpot = m.values["ttft_ms"], m.values["tpot_ms"]
        ttft_cell = f"{ttft:.0f} / {pred['ttft_ms']:.0f} ({pred['ttft_ms'] / ttft - 1:+.0%})"
        tpot_cell = f"{tpot:.1f} / {pred['tpot_ms']:.1f} ({pred['tpot_ms'] / tpot - 1:+.0%})"
        print(f"| {row.role} | {row.workload} | {row.params / 1e6:.1f} | {ttft_cell} | {tpot_cell} | {100 * row.tpot_spread:.0f} |")


if __name__ == "__main__":
    main()
