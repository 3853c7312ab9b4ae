"""Each search's rival: the best full-width homogeneous shape that meets the constraints (every head, one FFN width in
every kept layer, the fewest least important blocks dropped). The search keeps it, filled alike, where it scores better."""

from __future__ import annotations

from collections.abc import Callable

from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.metrics import Constraint
from autocompress.cost import CostModel
from autocompress.cost.base import meets


def homogeneous_full_kv(
    space: SearchSpace, drop_order: list[int], cost_model: CostModel, constraints: tuple[Constraint, ...]
) -> list[Architecture]:
    """Per FFN width of the space, the architecture with base hidden size and heads, that width in every kept layer,
    and the fewest blocks of `drop_order` (least important first) dropped that meets `constraints`; widest first."""
    base = space.base
    out = []
    for ffn in sorted((f for f in space.ffn if f > 0), reverse=True):
        for n_drop in range(len(drop_order) + 1):
            arch = space.homogeneous(base.hidden_size, base.blocks[0].kv_heads, ffn, set(drop_order[:n_drop]))
            if space.allows(arch) and meets(cost_model, constraints, arch):
                out.append(arch)
                break
    return out


def best_homogeneous(
    archs: list[Architecture],
    kl: Callable[[Architecture], float],
    screen: Callable[[Architecture], float] | None = None,
    keep: int = 3,
) -> tuple[Architecture, float] | None:
    """The architecture of `archs` (e.g. `homogeneous_full_kv`'s) with the lowest `kl`, and that KL; None if there is none.
    With `screen` (a cheaper estimate of `kl`, e.g. on part of the same split), only the `keep` best by it are measured by `kl`."""
    if screen is not None and len(archs) > keep:
        ranked = sorted(range(len(archs)), key=lambda i: screen(archs[i]))
        archs = [archs[i] for i in sorted(ranked[:keep])]
    scored = [(kl(a), i) for i, a in enumerate(archs)]
    if not scored:
        return None
    value, i = min(scored)
    return archs[i], value
