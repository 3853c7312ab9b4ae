"""The metric vocabulary: the four serving metrics, the direction of each, and a bound on one (Constraint).

Every module that names a metric or compares a cost against a bound takes it from here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autocompress.errors import ConfigError

METRICS: dict[str, str] = {
    # metric -> sense of its constraint: "max" (upper bound) or "min" (lower bound)
    "ttft_ms": "max",
    "tpot_ms": "max",
    "throughput_tok_s": "min",
    "memory_gib": "max",
}
TIMED = ("ttft_ms", "tpot_ms", "throughput_tok_s")  # the metrics a serving engine times (verify's estimates cover these)
ENGINE_MEASURED = (*TIMED, "kv_capacity_tokens")  # what profiling measures in the engine and a fit is validated on
PREDICTED = (*METRICS, "kv_capacity_tokens")  # what a cost model predicts
# The valid range of a bound: a multiple of the base model's cost ('NUMx'), or an absolute one in the metric's unit (ms,
# tokens/s, GiB). Outside it the search's cost / bound ratios overflow float32 (1e-300, 1e308) and every trial ends NaN.
RELATIVE_RANGE = (1e-3, 1e3)
ABSOLUTE_RANGE = (1e-6, 1e9)


@dataclass(frozen=True)
class Constraint:
    """A bound on one predicted metric; relative bounds are multiples of the base model's cost."""

    metric: str
    value: float
    relative: bool = False

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ConfigError(f"scenario.constraints.{self.metric} is not a known metric; use one of {sorted(METRICS)}")
        if not math.isfinite(self.value):
            raise ConfigError(f"scenario.constraints.{self.metric} must be a finite number, got {self.value!r}")
        if self.value <= 0:
            raise ConfigError(f"scenario.constraints.{self.metric} must be > 0, got {self.value!r}")
        low, high = RELATIVE_RANGE if self.relative else ABSOLUTE_RANGE
        if not low <= self.value <= high:
            shown = f"{self.value:g}x" if self.relative else f"{self.value:g}"
            what = "a multiple of the base model's cost" if self.relative else "an absolute bound in the metric's unit"
            raise ConfigError(f"scenario.constraints.{self.metric}={shown} is outside [{low:g}, {high:g}], the range of {what}")

    @property
    def sense(self) -> str:
        return METRICS[self.metric]

    def resolve(self, base_costs: Mapping[str, float]) -> Constraint:
        """The absolute form of this constraint, given the base model's predicted costs."""
        if not self.relative:
            return self
        base = float(base_costs[self.metric])
        if not math.isfinite(base) or base <= 0:
            fits = self.metric == "throughput_tok_s"
            why = "no sequence of the workload fits: check hardware.memory_gib" if fits else "check the hardware"
            raise ConfigError(
                f"scenario.constraints.{self.metric}={self.value:g}x: the base model's predicted {self.metric} is {base:g} ({why}); "
                f"give an absolute bound instead"
            )
        return Constraint(self.metric, self.value * base, relative=False)

    def tightened(self, margin: float) -> Constraint:
        """This (absolute) bound moved `margin` inside: an upper bound times 1 - margin, a lower one times 1 + margin."""
        if margin == 0:
            return self
        return Constraint(self.metric, self.value * (1 - margin if self.sense == "max" else 1 + margin), self.relative)

    def satisfied(self, value: float, tol: float = 1e-9) -> bool:
        if self.sense == "max":
            return value <= self.value * (1 + tol)
        return value >= self.value * (1 - tol)

    def describe(self) -> str:
        op = "<=" if self.sense == "max" else ">="
        bound = f"{self.value:g}x base" if self.relative else f"{self.value:.4g}"
        return f"{self.metric} {op} {bound}"

    @staticmethod
    def parse(metric: str, spec: Any) -> Constraint:
        """`0.6x` (relative to the base model) or a plain number (absolute, in the metric's unit)."""
        if isinstance(spec, bool):
            raise ConfigError(f"scenario.constraints.{metric} must be a number or 'NUMx', got {spec!r}")
        if isinstance(spec, int | float):
            return Constraint(metric, float(spec), relative=False)
        match = re.fullmatch(r"\s*([-+0-9.eE]+)\s*x\s*", str(spec))
        if match is None:
            raise ConfigError(
                f"scenario.constraints.{metric}={spec!r} is not understood; write a number in the "
                f"metric's unit (e.g. 12) or a multiple of the base model's cost (e.g. '0.6x')"
            )
        try:
            value = float(match.group(1))
        except ValueError as exc:
            raise ConfigError(f"scenario.constraints.{metric}={spec!r}: bad number") from exc
        return Constraint(metric, value, relative=True)
