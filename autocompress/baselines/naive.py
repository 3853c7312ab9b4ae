"""Architectures the search must beat at equal predicted cost.

Baselines that could win (scored by the caller on the report split):
- `homogeneous_full_kv`: full hidden size, every query and KV head; per FFN width on the grid, the
  fewest least-important blocks dropped that meet the constraints (more drops only lose quality);
  the caller keeps the one with the lowest selection-split KL;
- `greedy_removal`: attention and FFN sublayers removed one at a time, least important first
  (1 - cos of the residual stream across the sublayer), until every constraint holds.
Naive ones, kept for profiling designs: uniform-fraction shrinks and random feasible architectures.
"""

from __future__ import annotations

import random

from autocompress.arch.space import Architecture, Block, SearchSpace, uniform_shrink
from autocompress.config.metrics import Constraint
from autocompress.cost import CostModel
from autocompress.cost.base import meets


def uniform_architecture(
    space: SearchSpace, cost_model: CostModel, constraints: tuple[Constraint, ...], steps: int = 200
) -> Architecture | None:
    """The uniform shrink with the largest fraction f (in steps of 1/steps) that is feasible."""
    for k in range(steps, 0, -1):
        arch = uniform_shrink(space, k / steps)
        if meets(cost_model, constraints, arch):
            return arch
    return None


def random_feasible(
    space: SearchSpace, cost_model: CostModel, constraints: tuple[Constraint, ...], rng: random.Random, tries: int = 200
) -> Architecture | None:
    """A random architecture grown to the constraint boundary.

    Start from uniformly random options per decision (resampled until feasible), then upgrade random
    decisions one option at a time while the result stays feasible, so that it uses the cost budget
    as the searched architectures do.
    """
    n = space.num_layers
    for _ in range(tries):
        h = rng.randrange(len(space.hidden))
        att = [rng.randrange(floor, len(space.attention)) for floor in space.attention_floor]
        ffn = [rng.randrange(len(space.ffn)) for _ in range(n)]
        if meets(cost_model, constraints, space.architecture(h, att, ffn)):
            break
    else:
        return None
    while True:
        moves = [("h", 0)] if h + 1 < len(space.hidden) else []
        moves += [("a", layer) for layer in range(n) if att[layer] + 1 < len(space.attention)]
        moves += [("f", layer) for layer in range(n) if ffn[layer] + 1 < len(space.ffn)]
        rng.shuffle(moves)
        for kind, layer in moves:
            h2, a2, f2 = h + (kind == "h"), att.copy(), ffn.copy()
            if kind == "a":
                a2[layer] += 1
            elif kind == "f":
                f2[layer] += 1
            if meets(cost_model, constraints, space.architecture(h2, a2, f2)):
                h, att, ffn = h2, a2, f2
                break
        else:
            return space.architecture(h, att, ffn)


def greedy_removal(
    space: SearchSpace, order: list[tuple[str, int]], cost_model: CostModel, constraints: tuple[Constraint, ...]
) -> Architecture | None:
    """Remove sublayers in `order` (("attention" | "ffn", layer), least important first) from the base model until
    every constraint holds; widths stay the base model's. None if removing all of them is not enough."""
    blocks = list(space.base.blocks)
    for kind, layer in order:
        if kind == "attention" and space.attention_floor[layer] > 0:
            continue  # this layer must keep its attention
        b = blocks[layer]
        blocks[layer] = Block(0, b.ffn) if kind == "attention" else Block(b.kv_heads, 0)
        arch = Architecture(**{**space.base.__dict__, "blocks": tuple(blocks)})
        if meets(cost_model, constraints, arch):
            return arch
    return None
