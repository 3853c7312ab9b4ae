"""Puzzletron's mixed-integer program: one block (attention option x FFN option) per layer, the summed one-block
replacement scores minimised under additive per-block costs, solved by HiGHS through scipy's `milp`; and a brute
force that checks it on small instances.

As in ModelOpt's `mip_with_multi_layer_replacements`: one binary variable per (layer, block), exactly one block per
layer, and per constraint sum_r x_r * stat_c(r) <= budget_c (the bound less the non-block part).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from autocompress.errors import InfeasibleError


@dataclass(frozen=True)
class LinearBound:
    """sum over layers of the chosen blocks' `stat` <= `budget`."""

    metric: str
    stat: np.ndarray  # [L, B] the block's contribution to the (linearised) metric
    budget: float


@dataclass(frozen=True)
class Program:
    """Scores [L, B] of every block in every layer (lower is better; inf = not in that layer's library) and the bounds."""

    scores: np.ndarray
    bounds: tuple[LinearBound, ...]


def solve(program: Program, time_limit: float = 60.0, exclude: tuple[tuple[int, ...], ...] = ()) -> tuple[list[int], float]:
    """The block per layer minimising the summed scores under every bound, and that sum; none of the choices in
    `exclude` (one block index per layer each: the runner-up is the best choice other than the pick).

    Raises InfeasibleError when no choice meets the bounds (or the solver found none within `time_limit` seconds).
    """
    layers, blocks = program.scores.shape
    allowed = np.isfinite(program.scores).ravel()
    cost = np.where(allowed, program.scores.ravel(), 0.0)
    one_per_layer = np.kron(np.eye(layers), np.ones(blocks))  # [L, L*B]
    cuts = np.zeros((len(exclude), layers * blocks))  # no-good cuts: at most L - 1 of an excluded choice's blocks
    for row, choice in zip(cuts, exclude, strict=True):
        row[[i * blocks + c for i, c in enumerate(choice)]] = 1.0
    rows = [one_per_layer, cuts] + [b.stat.reshape(1, -1) for b in program.bounds]
    lo = np.concatenate([np.ones(layers), np.full(len(exclude) + len(program.bounds), -np.inf)])
    hi = np.concatenate([np.ones(layers), np.full(len(exclude), layers - 1.0), [b.budget for b in program.bounds]])
    res = milp(
        cost,
        integrality=np.ones(cost.size),
        bounds=Bounds(np.zeros(cost.size), allowed.astype(float)),  # a block outside the library is fixed at 0
        constraints=LinearConstraint(np.vstack(rows), lo, hi),
        options={"time_limit": time_limit},
    )
    if res.x is None:
        raise InfeasibleError(f"Puzzletron's MIP has no solution ({res.message}): no block per layer of its library meets the bounds")
    choice = np.round(res.x).reshape(layers, blocks).argmax(axis=1)
    return [int(c) for c in choice], float(res.fun)


def brute_force(program: Program, exclude: tuple[tuple[int, ...], ...] = ()) -> tuple[list[int], float]:
    """The same optimum by enumerating every choice (tests, small instances only)."""
    layers, blocks = program.scores.shape
    best: tuple[float, list[int]] | None = None
    for choice in itertools.product(range(blocks), repeat=layers):
        if choice in exclude:
            continue
        score = float(sum(program.scores[i, c] for i, c in enumerate(choice)))
        if not np.isfinite(score):
            continue
        feasible = all(sum(b.stat[i, c] for i, c in enumerate(choice)) <= b.budget + 1e-9 for b in program.bounds)
        if feasible and (best is None or score < best[0] - 1e-12):
            best = (score, list(choice))
    if best is None:
        raise InfeasibleError("no choice meets the bounds")
    return best[1], best[0]
