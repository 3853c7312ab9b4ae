"""One interface for every baseline compare can run: `pick(context) -> Pick`, registered once in BASELINES.

A baseline sees the unpruned model, the search space, the run's cost model and absolute constraints and the token
splits (it chooses on the selection split only) and returns its architecture with what compare records of it. Adding
a baseline (docs/baselines.md): a module with its settings dataclass and `pick(ctx, settings) -> Pick`, one entry in
BASELINES (`Baseline(pick, title, settings=ItsSpec)`), its defaults under `compare.<name>` in conf/compare/default.yaml.
Minitron sits here too, for both families compare runs (Llama: autocompress.baselines.minitron; hybrid MoE:
autocompress.baselines.minitron_moe). Minitron and Puzzletron pick among their top-N candidates with compare.probe
(`PickContext.probe`), as AutoCompress's trials are picked: every method gets the same probe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from autocompress.arch.masking import Ranking
from autocompress.arch.space import Architecture
from autocompress.config.families import LLAMA, family
from autocompress.config.metrics import Constraint
from autocompress.cost import CostModel

Writers = dict[str, Callable[[Path], object]]  # candidate name -> writes its checkpoint into a folder


@dataclass(frozen=True)
class Probe:
    """compare.probe as a baseline sees it: `run(writers)` distils each candidate briefly and scores it on the selection
    split (autocompress.quality.probe: one row per candidate; `chosen(rows)` names the pick)."""

    count: int  # candidates to probe
    run: Callable[[Writers], list[dict[str, Any]]]
    described: str  # how the card says it, e.g. "the best 3 again after 16,384 distillation tokens each"


@dataclass(frozen=True)
class PickContext:
    """What a baseline may use: the teacher, the space, the cost model, the bounds, calibration and selection tokens."""

    model: Any  # the unpruned model, frozen
    space: Any  # SearchSpace (None for a hybrid-MoE run: its shapes are not a SearchSpace's)
    cost_model: CostModel
    constraints: tuple[Constraint, ...]  # absolute
    calib: torch.Tensor  # [n, s] calibration split: importance, activation scores
    select: torch.Tensor  # [m, s] selection split: every choice among candidates
    teacher_select: torch.Tensor | None  # [m, s, d] the unpruned model's final hidden states on `select` (Llama family)
    progress: bool = True
    family: str = LLAMA  # LLAMA | HYBRID_MOE (config.families)
    tokenizer: Any = None  # saved with a checkpoint a pick writes itself
    check_ids: torch.Tensor | None = None  # tokens a written checkpoint is verified on (compare: 4 report-split sequences)
    probe: Probe | None = None  # compare.probe when it is on (only baselines registered with `probes` get it)
    runner_up: bool = False  # also return the runner-up by the same selection score (compare.runner_up: pick noise)

    def teacher(self) -> torch.Tensor:
        if self.teacher_select is None:
            raise ValueError("this context has no teacher hidden states (a hybrid-MoE run): the baseline cannot score by them")
        return self.teacher_select

    def probe_writer(self, ranking: Ranking, arch: Architecture) -> Callable[[Path], object]:
        """Writes `arch` (the teacher sliced by `ranking`) into a folder, verified: a candidate for `probe.run`."""
        from autocompress.baselines.minitron import write_checkpoint

        ids = self.check_ids if self.check_ids is not None else self.select[:4]
        return lambda folder: write_checkpoint(self.model, self.tokenizer, self.space, ranking, arch, folder, ids, "probe")


@dataclass
class Pick:
    """A baseline's architecture, how to slice the teacher's weights for it, and what it records."""

    arch: Architecture
    ranking: Ranking | None  # the unit order the checkpoint keeps (hidden channels, FFN neurons, query heads); None: `write` does
    label: str  # the method, as a reader knows it
    kl_select: float  # selection-split KL of the pick, before any training
    settings: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)  # limits, solves, shape: whatever explains the pick
    shape: dict[str, Any] | None = None  # the shape as compare.json records it; None: a Llama architecture's, per layer
    description: str = ""  # the card's sentence on the shape and how it was chosen; "" = the shape per layer
    table_label: str = ""  # the model's name in compare's table; "" = `label`
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)  # written beside the checkpoint as <name>.parquet
    write: Callable[[Path, str], object] | None = None  # writes the checkpoint with a card; None: the teacher sliced by `ranking`
    report: Callable[[torch.Tensor], tuple[float, float]] | None = None  # KL to the teacher, perplexity; None: the masked model's
    runner_up: Pick | None = None  # the second by the same selection score (when the context asks; None where there is none)

    def summary(self) -> dict[str, Any]:
        shape = self.shape
        if shape is None:
            blocks = self.arch.blocks
            shape = {
                "hidden_size": self.arch.hidden_size,
                "num_attention_heads": self.arch.num_attention_heads,
                "attention": "".join(str(b.kv_heads) if b.kv_heads else "-" for b in blocks),
                "ffn": [b.ffn for b in blocks],
            }
        return {
            "label": self.label,
            "table_label": self.table_label or self.label,
            "architecture": self.arch.to_json(),
            "params": self.arch.num_params(),
            **shape,
            "kl_select": self.kl_select,
            "settings": self.settings,
            **self.notes,
        }


def puzzletron_pick(ctx: PickContext, settings: Any) -> Pick:
    """ModelOpt's Puzzletron (autocompress.baselines.puzzletron). With compare.probe on, the MIP's N best choices (each
    realised alike) are probed as every method's candidates are; the runner-up is the second by the same score."""
    from autocompress.baselines import puzzletron

    n = ctx.probe.count if ctx.probe is not None else 1
    res = puzzletron.search(
        ctx.model,
        ctx.space,
        ctx.cost_model,
        ctx.constraints,
        ctx.calib,
        ctx.select,
        ctx.teacher(),
        settings,
        ctx.progress,
        max(n - 1, settings.choices - 1, int(ctx.runner_up)),
    )
    solves = [{"overshoot": s["overshoot"], "budgets": s["budgets"], "costs": s["costs"]} for s in res.solves]
    notes: dict[str, Any] = {"blocks": res.shape(), "solves": solves, "library": len(res.blocks), "costs": res.costs}
    notes["budget"] = {  # one-block scores on score_sequences of the selection split, then each MIP choice on all of it
        "one_block_evaluations": int(np.isfinite(res.scores).sum()),
        "one_block_sequences": len(ctx.select[: settings.score_sequences]),
        "selection_evaluations": 1 + len(res.others),
        "selection_sequences": len(ctx.select),
    }
    candidates = [(res.arch, res.kl_select), *res.others]  # MIP order: the pick first
    # the MIP's first choice, or with `choices` N the best of its N by selection-split KL (ties: MIP order)
    order = list(range(len(candidates))) if settings.choices == 1 else sorted(range(len(candidates)), key=lambda i: (candidates[i][1], i))
    if ctx.probe is not None and len(candidates) > 1:
        from autocompress.quality.probe import chosen

        rows = ctx.probe.run({str(i): ctx.probe_writer(res.ranking, candidates[i][0]) for i in order[:n]})
        after = {int(r["candidate"]): r["kl_select_probe"] for r in rows}
        order = sorted(after, key=lambda i: (after[i], i))
        assert order[0] == int(chosen(rows))
        # candidate i is the MIP's (i + 1)-th best choice
        notes["probe"] = [{"candidate": i, "kl_select": candidates[i][1], "kl_select_probe": after[i]} for i in after]
    (arch, kl), label = candidates[order[0]], puzzletron.LABEL
    if order[0] != 0:  # the probe's pick, not the MIP's first: its shape and costs (`solves` stay the first choice's)
        notes |= {"blocks": puzzletron.block_shape(arch), "costs": ctx.cost_model.predict(arch)}
    second = None
    if ctx.runner_up and len(order) > 1:
        second = Pick(candidates[order[1]][0], res.ranking, f"{label}, runner-up", candidates[order[1]][1], asdict(settings))
    return Pick(arch, res.ranking, label, kl, asdict(settings), notes, runner_up=second)


@dataclass(frozen=True)
class NaiveSpec:
    """Settings of the naive baselines (`compare.homogeneous`, `compare.greedy`)."""

    importance_sequences: int = 8  # calibration sequences for the block / sublayer importance (the search's own count)


def _selection_kl(ctx: PickContext, ranking: Ranking, arch: Architecture) -> float:
    from autocompress.arch.masking import MaskedModel
    from autocompress.search.differentiable import evaluate

    masked = MaskedModel(ctx.model, ctx.space, ranking)
    try:
        return evaluate(ctx.model, masked, arch, ctx.select, ctx.teacher())[0]
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
    scored = sorted((_selection_kl(ctx, ranking, a), i) for i, a in enumerate(archs))
    (kl, best), rest = scored[0], scored[1:]
    notes = {
        "candidates": len(archs),
        "ffn_widths": [a.blocks[next(i for i, b in enumerate(a.blocks) if b.ffn)].ffn for a in archs],
        "budget": {"selection_evaluations": len(archs), "selection_sequences": len(ctx.select)},
    }
    label = "homogeneous, full width (fewest blocks dropped)"
    second = Pick(archs[rest[0][1]], ranking, f"{label}, runner-up", rest[0][0], asdict(settings)) if ctx.runner_up and rest else None
    return Pick(archs[best], ranking, label, kl, asdict(settings), notes, runner_up=second)


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
    budget = {"budget": {"selection_evaluations": 1, "selection_sequences": len(ctx.select)}}  # its order is from calibration text
    return Pick(arch, ranking, "greedy sublayer removal", _selection_kl(ctx, ranking, arch), asdict(settings), budget)


def minitron_pick(ctx: PickContext, settings: Any) -> Pick:
    """ModelOpt's mcore_minitron as the run's model family prunes it (its `minitron` stage, config/families.py: Llama
    autocompress.baselines.minitron, hybrid MoE autocompress.baselines.minitron_moe)."""
    pick: Pick = family(ctx.family).stage("minitron")(ctx, settings)
    return pick


def minitron_key() -> dict[str, Any]:
    from autocompress.baselines.minitron import WIDENING

    return {"widening": WIDENING}  # a pick made under an older widening rule is not reused


BaselinePick = Callable[[PickContext, Any], Pick]


@dataclass(frozen=True)
class Baseline:
    """A registered baseline: its pick, its name in tables, the families it prunes."""

    pick: BaselinePick
    title: str
    llama_only: bool = True  # left out of a hybrid-MoE run's default methods, refused when named there
    probes: bool = False  # picks among its candidates with compare.probe when that is on
    key: Callable[[], dict[str, Any]] | None = None  # what else its pick depends on (part of its stage key)
    # Its settings dataclass, read from compare.<name> (conf/compare/default.yaml); None: a field of CompareSpec holds
    # them (the baselines shipped before this entry existed) or the baseline takes none.
    settings: type | None = None


BASELINES: dict[str, Baseline] = {
    "minitron": Baseline(minitron_pick, "Minitron", llama_only=False, probes=True, key=minitron_key),
    "minitron_default": Baseline(minitron_pick, "Minitron (ModelOpt defaults)", llama_only=False, probes=True, key=minitron_key),
    "puzzletron": Baseline(puzzletron_pick, "Puzzletron", probes=True),
    "homogeneous": Baseline(homogeneous_pick, "homogeneous"),
    "greedy": Baseline(greedy_pick, "greedy"),
}
