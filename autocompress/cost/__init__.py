"""Cost models of a serving engine: one interface (`CostModel`), several implementations."""

from autocompress.arch import SearchSpace
from autocompress.config import Scenario
from autocompress.cost.analytic import AnalyticCostModel
from autocompress.cost.base import COST_KEYS, ArchDistribution, CostModel

__all__ = ["COST_KEYS", "AnalyticCostModel", "ArchDistribution", "CostModel", "get_cost_model"]


def get_cost_model(space: SearchSpace, scenario: Scenario) -> CostModel:
    """The cost model for this scenario's hardware: the analytic roofline model."""
    return AnalyticCostModel(space, scenario.hardware, scenario.workload)
