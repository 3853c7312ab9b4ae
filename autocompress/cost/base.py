"""The cost-model interface the search sees: expected serving cost of a distribution over architectures."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.metrics import METRICS, PREDICTED, Constraint

COST_KEYS = tuple(METRICS)  # what constraints bound (config.metrics: the one metric table)
PREDICTED_KEYS = PREDICTED  # what a cost model predicts


@dataclass
class ArchDistribution:
    """Independent categorical distributions over the space's options.

    hidden: [H] probabilities of each global hidden size; attention: [L, A]; ffn: [L, F];
    heads: [Q] probabilities of each global query-head count (None = the base model's count).
    """

    hidden: torch.Tensor  # [H]
    attention: torch.Tensor  # [L, A]
    ffn: torch.Tensor  # [L, F]
    heads: torch.Tensor | None = None  # [Q]

    def query_heads(self, space: SearchSpace) -> torch.Tensor:
        """[Q] probabilities of the query-head options; one-hot on the base count when `heads` is None."""
        if self.heads is not None:
            return self.heads
        out = torch.zeros(len(space.heads), dtype=self.hidden.dtype)
        out[-1] = 1.0
        return out

    def to(self, dtype: torch.dtype) -> ArchDistribution:
        heads = None if self.heads is None else self.heads.to(dtype)
        return ArchDistribution(self.hidden.to(dtype), self.attention.to(dtype), self.ffn.to(dtype), heads)

    @staticmethod
    def one_hot(space: SearchSpace, arch: Architecture) -> ArchDistribution:
        h, att, ffn, q = space.indices(arch)
        dt, one_hot = torch.float64, torch.nn.functional.one_hot
        return ArchDistribution(
            hidden=one_hot(torch.tensor(h), len(space.hidden)).to(dt),
            attention=one_hot(torch.tensor(att), len(space.attention)).to(dt),
            ffn=one_hot(torch.tensor(ffn), len(space.ffn)).to(dt),
            heads=one_hot(torch.tensor(q), len(space.heads)).to(dt),
        )


class CostModel(ABC):
    """Predicts TTFT (ms), TPOT (ms), output throughput (tokens/s), serving memory (GiB), KV-cache capacity (tokens).

    Implementations: `AnalyticCostModel` (roofline with efficiency terms from the hardware config);
    a model fitted to engine measurements plugs in by implementing `expected`.
    """

    space: SearchSpace

    @property
    @abstractmethod
    def id(self) -> str:
        """Stable name recorded with every result row (e.g. `analytic/h100_sxm/v1`)."""

    @abstractmethod
    def expected(self, dist: ArchDistribution) -> dict[str, torch.Tensor]:
        """Expected costs under `dist`, differentiable with respect to its probabilities."""

    def extrapolates(self, arch: Architecture) -> bool:
        """Is `arch` (on this model's workload) outside what the model was fitted on? Never, for unfitted models."""
        return False

    def describe(self) -> dict[str, object]:
        """What to record about this model next to results."""
        return {"id": self.id}

    def predict(self, arch: Architecture) -> dict[str, float]:
        """Costs of one architecture of the space."""
        with torch.no_grad():
            out = self.expected(ArchDistribution.one_hot(self.space, arch))
        return {k: float(v) for k, v in out.items()}


def meets(cost_model: CostModel, constraints: tuple[Constraint, ...], arch: Architecture) -> bool:
    costs = cost_model.predict(arch)
    return all(c.satisfied(costs[c.metric]) for c in constraints)
