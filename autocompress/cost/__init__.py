"""Cost models of a serving engine: one interface (`CostModel`), several implementations."""

import sys
from pathlib import Path

from autocompress.arch.space import SearchSpace
from autocompress.config.schema import Scenario
from autocompress.cost.analytic import AnalyticCostModel
from autocompress.cost.base import COST_KEYS, PREDICTED_KEYS, ArchDistribution, CostModel
from autocompress.cost.fitted import FittedCostModel, latest_record, load_record, records
from autocompress.errors import ConfigError

__all__ = ["COST_KEYS", "PREDICTED_KEYS", "AnalyticCostModel", "ArchDistribution", "CostModel", "FittedCostModel", "get_cost_model"]


def get_cost_model(space: SearchSpace, scenario: Scenario, results_dir: str | Path = "results", choice: str = "auto") -> CostModel:
    """The cost model for this scenario's hardware.

    choice: "auto" = the newest model fitted for this hardware + engine (on a CPU: fitted on this
    CPU, `hardware.cpu`) under <results_dir>/cost_models/, else the one shipped in the package
    (autocompress/cost/fits: the GPUs' fits to aiconfigurator's kernel estimates), else the analytic
    one; "analytic"; or the path of a fitted model file. A fit from another CPU is never applied: auto says so and takes the
    analytic model, an explicit file is refused.
    """
    hw = scenario.hardware
    if choice == "analytic":
        return AnalyticCostModel(space, hw, scenario.workload)
    if choice == "auto":
        record = latest_record(results_dir, hw.name, hw.engine, cpu=hw.cpu) or latest_record(None, hw.name, hw.engine, cpu=hw.cpu)
        if record is None:
            others = sorted({str(r.get("cpu")) for r in records(results_dir, hw.name, hw.engine)}) if hw.cpu else []
            if others:
                print(
                    f"[autocompress] cost model: the fits of {hw.name}/{hw.engine} in {results_dir}/cost_models were measured on "
                    f"other CPUs ({', '.join(others)}), not on this one ({hw.cpu}): using the analytic model; "
                    f"python -m autocompress.profile +scenario={scenario.name} fits one here",
                    file=sys.stderr,
                    flush=True,
                )
            return AnalyticCostModel(space, hw, scenario.workload)
    else:
        record = load_record(choice)
        if (record["hardware"], record["engine"]) != (hw.name, hw.engine):
            raise ConfigError(
                f"cost_model={choice!r} was fitted for {record['hardware']}/{record['engine']}, "
                f"but the scenario runs on {hw.name}/{hw.engine}; use cost_model=auto or a matching file"
            )
        if hw.cpu and record.get("cpu") != hw.cpu:
            raise ConfigError(
                f"cost_model={choice!r} was measured on CPU {record.get('cpu') or '(not recorded)'}, this is {hw.cpu}; "
                f"a fit holds only on its CPU: fit one here with python -m autocompress.profile +scenario={scenario.name}, "
                "or use cost_model=analytic"
            )
    return FittedCostModel(space, hw, scenario.workload, record)
