"""Cost models of a serving engine: one interface (`CostModel`), several implementations."""

from pathlib import Path

from autocompress.arch import SearchSpace
from autocompress.config import Scenario
from autocompress.cost.analytic import AnalyticCostModel
from autocompress.cost.base import COST_KEYS, PREDICTED_KEYS, ArchDistribution, CostModel
from autocompress.cost.fitted import FittedCostModel, latest_record, load_record
from autocompress.errors import ConfigError

__all__ = ["COST_KEYS", "PREDICTED_KEYS", "AnalyticCostModel", "ArchDistribution", "CostModel", "FittedCostModel", "get_cost_model"]


def get_cost_model(space: SearchSpace, scenario: Scenario, results_dir: str | Path = "results", choice: str = "auto") -> CostModel:
    """The cost model for this scenario's hardware.

    choice: "auto" = the newest model fitted for this hardware + engine under
    <results_dir>/cost_models/, else the analytic one; "analytic"; or the path of a fitted model file.
    """
    hw = scenario.hardware
    if choice == "analytic":
        return AnalyticCostModel(space, hw, scenario.workload)
    if choice == "auto":
        record = latest_record(results_dir, hw.name, hw.engine)
        if record is None:
            return AnalyticCostModel(space, hw, scenario.workload)
    else:
        record = load_record(choice)
        if (record["hardware"], record["engine"]) != (hw.name, hw.engine):
            raise ConfigError(
                f"cost_model={choice!r} was fitted for {record['hardware']}/{record['engine']}, "
                f"but the scenario runs on {hw.name}/{hw.engine}; use cost_model=auto or a matching file"
            )
    return FittedCostModel(space, hw, scenario.workload, record)
