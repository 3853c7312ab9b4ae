"""One interface for every baseline compare can run: `pick(context) -> Pick`, registered once in BASELINES.

A baseline sees the unpruned model, the search space, the run's cost model and absolute constraints and the token
splits (it chooses on the selection split only) and returns its architecture with what compare records of it. Adding
a baseline (docs/baselines.md): a function `pick(ctx, settings) -> Pick` here (or in its own module), one entry in
BASELINES, its settings dataclass as a field of CompareSpec and under `compare.<name>` in conf/compare/default.yaml.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autocompress.arch.masking import Ranking
from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.metrics import Constraint
from autocompress.cost import CostModel


@dataclass(frozen=True)
class PickContext:
    """What a baseline may use: the teacher, the space, the cost model, the bounds, calibration and selection tokens."""

    model: Any  # the unpruned model, frozen
    space: SearchSpace
    cost_model: CostModel
    constraints: tuple[Constraint, ...]  # absolute
    calib: torch.Tensor  # [n, s] calibration split: importance, activation scores
    select: torch.Tensor  # [m, s] selection split: every choice among candidates
    teacher_select: torch.Tensor  # [m, s, d] the unpruned model's final hidden states on `select`
    progress: bool = True


@dataclass
class Pick:
    """A baseline's architecture, how to slice the teacher's weights for it, and what it records."""

    arch: Architecture
    ranking: Ranking  # the unit order the checkpoint keeps (hidden channels, FFN neurons, query heads)
    label: str  # the method, as a reader knows it
    kl_select: float  # selection-split KL of the pick, before any training
    settings: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)  # limits, solves, shape: whatever explains the pick

    def summary(self) -> dict[str, Any]:
        blocks = self.arch.blocks
        return {
            "label": self.label,
            "architecture": self.arch.to_json(),
            "params": self.arch.num_params(),
            "hidden_size": self.arch.hidden_size,
            "num_attention_heads": self.arch.num_attention_heads,
            "attention": "".join(str(b.kv_heads) if b.kv_heads else "-" for b in blocks),
            "ffn": [b.ffn for b in blocks],
            "kl_select": self.kl_select,
            "settings": self.settings,
            **self.notes,
        }


def puzzletron_pick(ctx: PickContext, settings: Any) -> Pick:
    """ModelOpt's Puzzletron (autocompress.baselines.puzzletron)."""
    from autocompress.baselines import puzzletron

    res = puzzletron.search(
        ctx.model, ctx.space, ctx.cost_model, ctx.constraints, ctx.calib, ctx.select, ctx.teacher_select, settings, ctx.progress
    )
    solves = [{"overshoot": s["overshoot"], "budgets": s["budgets"], "costs": s["costs"]} for s in res.solves]
    notes = {"blocks": res.shape(), "solves": solves, "library": len(res.blocks), "costs": res.costs}
    return Pick(res.arch, res.ranking, puzzletron.LABEL, res.kl_select, asdict(settings), notes)


@dataclass(frozen=True)
class NaiveSpec:
    """Settings of the naive baselines (`compare.homogeneous`, `compare.greedy`)."""

    importance_sequences: int = 8  # calibration sequences for the block / sublayer importance (the search's own count)


def _selection_kl(ctx: PickContext, ranking: Ranking, arch: Architecture) -> float:
    from autocompress.arch.masking import MaskedModel
    from autocompress.search.differentiable import evaluate

    masked = MaskedModel(ctx.model, ctx.space, ranking)
    try:
        return evaluate(ctx.model, masked, arch, ctx.select, ctx.teacher_select)[0]
    finally:
        masked.remove()


def homogeneous_pick(ctx: PickContext, settings: NaiveSpec) -> Pick:
    """Full hidden size and every head, one FFN width in every kept layer, the fewest least-important blocks dropped that
    fit (autocompress.search.rival); the width with the lowest selection-split KL."""
    from autocompress.arch.importance import importance
    from autocompress.errors import InfeasibleError
    from autocompress.search.rival import homogeneous_full_kv

    imp = importance(ctx.model, ctx.calib[: settings.importance_sequences], progress=ctx.progress)
    ranking = imp.ranking()
    archs = homogeneous_full_kv(ctx.space, imp.drop_order(), ctx.cost_model, ctx.constraints)
    if not archs:
        raise InfeasibleError("no full-width homogeneous shape meets the constraints; drop `homogeneous` from compare.methods")
    kl, best = min(((_selection_kl(ctx, ranking, a), i) for i, a in enumerate(archs)))
    notes = {"candidates": len(archs), "ffn_widths": [a.blocks[next(i for i, b in enumerate(a.blocks) if b.ffn)].ffn for a in archs]}
    return Pick(archs[best], ranking, "homogeneous, full width (fewest blocks dropped)", kl, asdict(settings), notes)


def greedy_pick(ctx: PickContext, settings: NaiveSpec) -> Pick:
    """Attention and FFN sublayers removed least important first (1 - cos across the sublayer) until every bound holds."""
    from autocompress.arch.importance import importance, sublayer_order
    from autocompress.baselines.naive import greedy_removal
    from autocompress.errors import InfeasibleError

    calib = ctx.calib[: settings.importance_sequences]
    arch = greedy_removal(ctx.space, sublayer_order(ctx.model, calib), ctx.cost_model, ctx.constraints)
    if arch is None:
        raise InfeasibleError("removing every sublayer does not meet the constraints; drop `greedy` from compare.methods")
    ranking = importance(ctx.model, calib, progress=ctx.progress).ranking()  # widths stay the base's: the order is moot
    return Pick(arch, ranking, "greedy sublayer removal", _selection_kl(ctx, ranking, arch), asdict(settings))


BaselinePick = Callable[[PickContext, Any], Pick]


@dataclass(frozen=True)
class Baseline:
    """A registered baseline: its pick, its name in tables, the families it prunes."""

    pick: BaselinePick
    title: str
    llama_only: bool = True  # left out of a hybrid-MoE run's default methods, refused when named there


BASELINES: dict[str, Baseline] = {
    "puzzletron": Baseline(puzzletron_pick, "Puzzletron"),
    "homogeneous": Baseline(homogeneous_pick, "homogeneous"),
    "greedy": Baseline(greedy_pick, "greedy"),
}
