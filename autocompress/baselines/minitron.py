"""The Minitron baseline as NVIDIA Model Optimizer's `mcore_minitron` (nvidia-modelopt 0.47) prunes a Llama-family model.

Importance on calibration text (ModelOpt's aggregation: per sequence the mean |activation| over
tokens, then the L2 norm over sequences):
- hidden channels: the outputs of every layer's two RMSNorms (the norms fused into QKV and FC1 in
  Megatron), each norm's L2 score summed over norms;
- query heads: per channel of the attention output projection's input, then the L2 norm over each
  head's channels; heads ranked within their KV group, whole heads removed (never averaged);
- FFN neurons: the input of each layer's down projection, act(gate(x)) * up(x);
- blocks (depth): sum over batches of 1 - mean cosine(block input, block output); the lowest are dropped.
KV groups are not pruned (ModelOpt >= 0.41 ignores `num_query_groups`). Candidates form ModelOpt's
grid: per axis the choices are the multiples of the axis's divisor up to the base size (query heads:
multiples of the KV-group count; layers: multiples of 2, ModelOpt's num_layers_divisor), of which the top `max_width_pruning` share of the
choices (depth: `max_depth_pruning`) is kept, `sorted(choices)[int((1 - p) * len):]`; widths are the
same in every layer. Every candidate that meets all constraints under the same cost model is kept,
the `top_k` with the most parameters are scored by KL to the unpruned model on the selection split
(the role of ModelOpt's `score_func`), and the best is chosen. Where no candidate meets the
constraints within ModelOpt's limits (0.4 width, 0.2 depth), the limits are widened a level at a time
(every pair raised by the same total) until one pair admits `top_k` candidates; the top-k of every pair
of that level are scored alike, and the limits of the pick and all pairs tried are recorded. Deviations from ModelOpt: divisors are
the search space's (as for AutoCompress); layer 0 is never dropped (vLLM 0.32 cannot serve a
DeciLM whose first layer has no attention); candidates must also lie in the search space.
`prune_kv_groups=true` is an ablation, not Minitron: KV heads mean-pooled in groups, as the search does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import pandas as pd
import torch
from tqdm.auto import tqdm

from autocompress.arch.importance import Importance, importance
from autocompress.arch.masking import MaskedModel, Ranking
from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.metrics import Constraint
from autocompress.cost import CostModel
from autocompress.errors import ConfigError, InfeasibleError
from autocompress.search.differentiable import evaluate

WIDEN_STEP = 0.1  # how far each widening step raises one limit
WIDENING = "levels-scored"  # the widening rule (feasible_candidates); compare's stage key holds it
LAYERS_DIVISOR = 2  # ModelOpt's default num_layers_divisor: layer counts are even (or the full depth)


@dataclass(frozen=True)
class MinitronSpec:
    """ModelOpt's search settings (conf/compare/default.yaml, `compare.minitron`)."""

    top_k: int = 10  # candidates (most parameters first) scored on the selection split
    max_width_pruning: float = 0.4  # ModelOpt's default: keep the top 40 % of each width axis's choices
    max_depth_pruning: float = 0.2  # ModelOpt's default: keep the top 20 % of the layer-count choices
    widen: bool = True  # no candidate within the limits: raise them a level at a time, the score picks among the level's pairs (recorded)
    widen_all: bool = (
        False  # tuned: the top-k of every pair at every level up to 0.9 / 0.9 scored, the best kept (not only the first level)
    )
    layers_divisor: int = LAYERS_DIVISOR  # ModelOpt's num_layers_divisor (2); 1 = any layer count (ModelOpt accepts it)
    prune_kv_groups: bool = False  # ablation, not Minitron: KV heads mean-pooled in groups as the search does
    importance_sequences: int | None = 16  # calibration sequences for the activation importance; None = the whole calibration split
    score_sequences: int | None = None  # selection-split sequences for the score (KL to the unpruned model); None = all
    budget: int | None = None  # candidates scored in all: the N with the most parameters over every pair scored (None: top_k per pair)

    def __post_init__(self) -> None:
        for key in ("top_k", "importance_sequences", "score_sequences", "layers_divisor", "budget"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                raise ConfigError(f"compare.minitron.{key} must be > 0, got {getattr(self, key)!r}")
        for key in ("max_width_pruning", "max_depth_pruning"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"compare.minitron.{key} must be in [0, 1), got {getattr(self, key)!r}")

    @property
    def label(self) -> str:
        if self.prune_kv_groups:
            return "homogeneous, mean-pooled KV (ablation)"
        tuned = [*(["every limit pair scored"] if self.widen_all else []), *(["any layer count"] if self.layers_divisor == 1 else [])]
        return f"Minitron (ModelOpt mcore_minitron{', tuned: ' + ', '.join(tuned) if tuned else ''})"

    @classmethod
    def tuned(cls) -> MinitronSpec:
        """As a careful user of ModelOpt tunes it with its own knobs (issue 43): the top-k of every limit pair up to
        0.9 / 0.9 scored on the selection split, the best kept; any layer count (num_layers_divisor 1; hybrid-MoE
        runs keep ModelOpt's 2); importance from the whole calibration split. compare's `minitron`; ModelOpt's
        defaults are `minitron_default`."""
        return cls(widen_all=True, layers_divisor=1, importance_sequences=None)


# --------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    """A homogeneous architecture: every kept layer has `heads` query heads, `kv_heads` and `ffn`; `dropped` blocks are no-op."""

    arch: Architecture
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    dropped: tuple[int, ...]
    params: int
    costs: dict[str, float]


def modelopt_choices(full: int, divisor: int, max_pruning: float) -> list[int]:
    """ModelOpt's choices of one axis: multiples of `divisor` up to `full` (and `full`), the top share kept.

    `sorted(choices)[int((1 - max_pruning) * len(choices)):]`, as `_generate_search_space_combos` filters them
    (the full size always stays: at max_pruning 0 that slice would be empty).
    """
    choices = sorted({*range(divisor, full + 1, divisor), full})
    return choices[min(int((1 - max_pruning) * len(choices)), len(choices) - 1) :]


def _divisor(options: tuple[int, ...]) -> int:
    """The step of a search-space axis: the gcd of its non-zero options."""
    return math.gcd(*(o for o in options if o > 0))


@dataclass(frozen=True)
class Grid:
    """The choices of every axis at one pair of limits."""

    hidden: list[int]
    heads: list[int]
    kv: list[int]
    ffn: list[int]
    drops: list[int]  # how many blocks may be dropped


def grid(space: SearchSpace, spec: MinitronSpec, width: float, depth: float, n_droppable: int) -> Grid:
    """ModelOpt's grid at the limits (`width`, `depth`), restricted to what the search space holds."""
    base, blk = space.base, space.base.blocks[0]
    groups = blk.kv_heads
    hidden = [h for h in modelopt_choices(base.hidden_size, _divisor(space.hidden), width) if h in space.hidden]
    heads = [q for q in modelopt_choices(base.num_attention_heads, groups, width) if q in space.heads]
    ffn = [f for f in modelopt_choices(blk.ffn, _divisor(space.ffn), width) if f in space.ffn]
    kv = [k for k in space.attention if k > 0] if spec.prune_kv_groups else [groups]
    depth_ok = 0 in space.attention and 0 in space.ffn
    layers = modelopt_choices(space.num_layers, spec.layers_divisor, depth)
    drops = sorted({space.num_layers - n for n in layers if space.num_layers - n <= n_droppable}) if depth_ok else [0]
    return Grid(hidden, heads, kv, ffn, drops or [0])


def enumerate_candidates(
    space: SearchSpace,
    drop_order: list[int],
    cost_model: CostModel,
    constraints: tuple[Constraint, ...],
    spec: MinitronSpec,
    width: float | None = None,
    depth: float | None = None,
    priced: dict[tuple[int, ...], tuple[Architecture, dict[str, float]]] | None = None,
) -> list[Candidate]:
    """Every homogeneous candidate of the grid at the limits (default: the spec's) that meets all `constraints`, most parameters first.

    `priced` keeps each shape's architecture and predicted costs across calls: the grids of wider limits
    contain the narrower ones, and widening step by step would otherwise price the same shapes again.
    """
    priced = {} if priced is None else priced
    g = grid(
        space, spec, spec.max_width_pruning if width is None else width, spec.max_depth_pruning if depth is None else depth, len(drop_order)
    )
    found = []
    for hidden, heads, kv, ffn, n_drop in itertools.product(g.hidden, g.heads, g.kv, g.ffn, g.drops):
        if heads % kv:
            continue
        dropped = tuple(sorted(drop_order[:n_drop]))
        shape = (hidden, heads, kv, ffn, n_drop)
        if shape not in priced:
            arch = space.homogeneous(hidden, kv, ffn, dropped, heads)
            priced[shape] = (arch, cost_model.predict(arch))
        arch, costs = priced[shape]
        if all(c.satisfied(costs[c.metric]) for c in constraints):
            found.append(Candidate(arch, hidden, heads, kv, ffn, dropped, arch.num_params(), costs))
    found.sort(key=lambda c: (-c.params, -c.hidden, -c.heads, -c.kv_heads, -c.ffn, len(c.dropped)))
    return found


def limit_levels(spec: MinitronSpec) -> list[list[tuple[float, float]]]:
    """(width, depth) limit pairs to try, by level: level 0 is the spec's pair; level n (when `widen`) every pair
    raised n steps of `WIDEN_STEP` in total over the spec's (neither limit lowered, neither above 0.9), depth
    raised most first."""
    w0, d0 = spec.max_width_pruning, spec.max_depth_pruning
    levels = [[(w0, d0)]]
    if not (spec.widen or spec.widen_all):
        return levels
    w_room, d_room = (max(0, round((0.9 - x) / WIDEN_STEP)) for x in (w0, d0))
    for n in range(1, w_room + d_room + 1):
        ups = range(max(0, n - d_room), min(n, w_room) + 1)  # steps given to width, the rest to depth
        levels.append([(round(w0 + up * WIDEN_STEP, 6), round(d0 + (n - up) * WIDEN_STEP, 6)) for up in ups])
    return levels


Found = TypeVar("Found", bound=Sized)


@dataclass(frozen=True)
class Admitted(Generic[Found]):
    """The feasible candidates (most parameters first) at one pair of limits."""

    width: float
    depth: float
    candidates: Found


def widen_limits(spec: MinitronSpec, found_at: Callable[[float, float], Found]) -> tuple[list[Admitted[Found]], dict[str, Any]]:
    """The limit pairs whose candidates the score chooses among (empty: none at any level), and a record of the limits tried.

    `found_at(width, depth)`: the feasible candidates at one pair of limits, most parameters first.
    Within ModelOpt's limits, whatever they admit (ModelOpt's own list, however short). When those admit
    nothing, the limits are widened a level at a time (`limit_levels`: every pair raised the same total
    number of steps) until one pair admits `top_k` candidates; every pair of that level that admits any is
    kept, and the score (selection-split KL) decides among their top-k lists, as it decides within one. A
    fixed order of pairs would decide for it: in rtx5080_game (2026-12-01) widening depth, then width, one
    step at a time reached 0.5 / 0.4 (hidden 320-448), while 0.4 / 0.5, the same total widening, picks
    hidden 576 with 16 layers at report KL 2.21 (benchmarks/minitron_limits.py). If no level reaches
    `top_k`, the level whose best pair admits the most holds (the earliest on ties).
    """
    defaults = (spec.max_width_pruning, spec.max_depth_pruning)
    tried: list[dict[str, Any]] = []
    best_level: list[Admitted[Found]] = []
    if spec.widen_all:  # tuned: every pair of every level that admits any, all scored alike
        every = []
        for level in limit_levels(spec):
            for width, depth in level:
                found = found_at(width, depth)
                tried.append({"max_width_pruning": width, "max_depth_pruning": depth, "feasible": len(found)})
                if len(found):
                    every.append(Admitted(width, depth, found))
        return every, {"widened": [(a.width, a.depth) for a in every] != [defaults], "tried": tried}
    for level in limit_levels(spec):
        admitted = []
        for width, depth in level:
            found = found_at(width, depth)
            tried.append({"max_width_pruning": width, "max_depth_pruning": depth, "feasible": len(found)})
            if len(found):
                admitted.append(Admitted(width, depth, found))
        if not admitted:
            continue
        most = max(len(a.candidates) for a in admitted)
        if level == [defaults] or most >= spec.top_k:
            best_level = admitted
            break
        if most > max((len(a.candidates) for a in best_level), default=0):
            best_level = admitted
    return best_level, {"widened": [(a.width, a.depth) for a in best_level] != [defaults], "tried": tried}


def feasible_candidates(
    space: SearchSpace, drop_order: list[int], cost_model: CostModel, constraints: tuple[Constraint, ...], spec: MinitronSpec
) -> tuple[list[Admitted[list[Candidate]]], dict[str, Any]]:
    """`widen_limits` over the homogeneous candidates of the search space (each shape priced once across the levels)."""
    priced: dict[tuple[int, ...], tuple[Architecture, dict[str, float]]] = {}

    def found_at(width: float, depth: float) -> list[Candidate]:
        return enumerate_candidates(space, drop_order, cost_model, constraints, spec, width, depth, priced)

    best_level, record = widen_limits(spec, found_at)
    if best_level:
        return best_level, record
    bounds = ", ".join(c.describe() for c in constraints)
    hint = "" if spec.widen else "; set compare.minitron.widen=true or raise max_width_pruning / max_depth_pruning"
    raise InfeasibleError(f"no homogeneous Minitron candidate in the search space meets {bounds}{hint}")


def to_score(admitted: list[Admitted[list[Candidate]]], top_k: int) -> list[tuple[Candidate, list[str]]]:
    """The union of each pair's top-k (each candidate once, most parameters first) with the pairs ("width/depth") whose top-k holds it."""
    where: dict[str, tuple[Candidate, list[str]]] = {}
    for a in admitted:
        for cand in a.candidates[:top_k]:
            where.setdefault(cand.arch.to_json(), (cand, []))[1].append(f"{a.width:g}/{a.depth:g}")
    return sorted(where.values(), key=lambda cw: (-cw[0].params, -cw[0].hidden, -cw[0].heads, -cw[0].ffn, len(cw[0].dropped)))


@dataclass
class MinitronResult:
    best: Candidate
    ranking: Ranking
    importance: Importance
    scored: pd.DataFrame  # the top-k: hidden, heads, kv_heads, ffn, dropped, params, costs, kl, perplexity, chosen
    feasible: int  # homogeneous candidates that meet the constraints at the limits scored (each counted once)
    limits: dict[str, Any]  # max_width_pruning, max_depth_pruning of the pick, widened, tried: every pair tried and what it admitted
    candidates: list[Candidate] = field(default_factory=list)  # the scored candidates, in the rows of `scored`


def search(
    model: Any,
    space: SearchSpace,
    cost_model: CostModel,
    constraints: tuple[Constraint, ...],
    calib: torch.Tensor,
    score_tokens: torch.Tensor,
    teacher_score: torch.Tensor,
    spec: MinitronSpec,
    progress: bool = True,
) -> MinitronResult:
    """Minitron's pick: importance on `calib`, the feasible homogeneous candidates, the best of the top-k by KL on `score_tokens`.

    `score_tokens` come from the selection split; `teacher_score` [n, s, d]: the unpruned model's final hidden states on them.
    """
    imp = importance(model, calib[: spec.importance_sequences], progress=progress)
    ranking = imp.ranking()
    admitted, record = feasible_candidates(space, imp.drop_order(), cost_model, constraints, spec)
    # a budget: the union of every pair's top-N, most parameters first, cut at N (ModelOpt's order over all the pairs)
    scored_cands = to_score(admitted, spec.budget or spec.top_k)[: spec.budget]
    masked = MaskedModel(model, space, ranking)
    rows = []
    try:
        for cand, pairs in tqdm(scored_cands, desc="minitron candidates", disable=not progress):
            kl, ppl = evaluate(model, masked, cand.arch, score_tokens, teacher_score)
            rows.append(
                {
                    "hidden": cand.hidden,
                    "num_attention_heads": cand.heads,
                    "kv_heads": cand.kv_heads,
                    "ffn": cand.ffn,
                    "dropped": list(cand.dropped),
                    "layers_kept": space.num_layers - len(cand.dropped),
                    "params": cand.params,
                    **cand.costs,
                    "kl": kl,
                    "perplexity": ppl,
                    "architecture": cand.arch.to_json(),
                    "limits": pairs,
                }
            )
    finally:
        masked.remove()
    scored = pd.DataFrame(rows)
    best_row = int(scored["kl"].idxmin())
    scored["chosen"] = scored.index == best_row
    width, depth = (float(x) for x in rows[best_row]["limits"][0].split("/"))
    limits = {"max_width_pruning": width, "max_depth_pruning": depth, **record}
    feasible = len({c.arch.to_json() for a in admitted for c in a.candidates})
    return MinitronResult(scored_cands[best_row][0], ranking, imp, scored, feasible, limits, [c for c, _ in scored_cands])


def pick(ctx: Any, spec: MinitronSpec) -> Any:
    """Minitron's pick behind the baseline interface (autocompress.baselines.interface.PickContext -> Pick): `search`
    scored on `spec.score_sequences` of the selection split, then, with compare.probe on, the best of its top candidates
    after a short distillation each (autocompress.quality.probe: the Minitron paper's step)."""
    from autocompress.baselines.interface import Pick

    n = spec.score_sequences
    select, teacher = ctx.select[:n], ctx.teacher()[:n]
    res = search(ctx.model, ctx.space, ctx.cost_model, ctx.constraints, ctx.calib, select, teacher, spec, ctx.progress)
    best = res.best
    probed = ""
    if ctx.probe is not None:  # its top candidates by selection KL, distilled briefly, scored again (as AutoCompress's)
        from autocompress.quality.probe import chosen

        top = res.scored.nsmallest(ctx.probe.count, "kl", keep="first")

        rows = ctx.probe.run({str(i): ctx.probe_writer(res.ranking, res.candidates[int(i)].arch) for i in top.index})
        res.scored["kl_select_probe"] = float("nan")
        for r in rows:
            res.scored.loc[int(r["candidate"]), "kl_select_probe"] = r["kl_select_probe"]
        chosen_at = int(chosen(rows))
        res.scored["chosen"] = res.scored.index == chosen_at
        best = res.candidates[chosen_at]
        probed = f" ({ctx.probe.described})"
    lim = res.limits
    scored_pairs = sorted({pair for pairs in res.scored["limits"] for pair in pairs})
    limits = f"the pick's max_width_pruning {lim['max_width_pruning']} / max_depth_pruning {lim['max_depth_pruning']}" + (
        f", widened beyond ModelOpt's defaults; pairs scored: {', '.join(scored_pairs)}" if lim["widened"] else ""
    )
    description = (
        f"Homogeneous: hidden {best.hidden}, {best.heads} query heads, {best.kv_heads} KV heads, FFN {best.ffn}, "
        f"dropped blocks {list(best.dropped) or 'none'}; {best.params:,} parameters; best selection-split KL of the top "
        f"{f'{spec.budget} over all limit pairs' if spec.budget else f'{spec.top_k} per limit pair'}{probed}, "
        f"{len(res.scored)} scored of {res.feasible} feasible homogeneous candidates "
        f"(limits: {limits})"
    )
    second = None
    if ctx.runner_up and len(res.scored) > 1:  # the second by the score that chose the pick (after the probe, where it ran)
        by = "kl_select_probe" if "kl_select_probe" in res.scored and res.scored["kl_select_probe"].notna().sum() > 1 else "kl"
        at = int(res.scored[~res.scored["chosen"]].sort_values(by, kind="stable").index[0])
        cand = res.candidates[at]
        second = Pick(cand.arch, res.ranking, f"{spec.label}, runner-up", float(res.scored.loc[at, "kl"]), shape=_shape(cand))
    return Pick(
        best.arch,
        res.ranking,
        spec.label,
        float(res.scored.loc[res.scored["chosen"], "kl"].iloc[0]),
        notes={
            "feasible_candidates": res.feasible,
            "limits": res.limits,
            "budget": {"selection_evaluations": len(res.scored), "selection_sequences": len(select)},
        },
        shape=_shape(best),
        description=description,
        table_label=f"{spec.label}: {ctx.space.num_layers - len(best.dropped)} layers, {best.heads} query heads",
        tables={"candidates": res.scored},
        runner_up=second,
    )


def _shape(cand: Candidate) -> dict[str, Any]:
    """A homogeneous candidate's shape as compare.json records it."""
    return {
        "hidden_size": cand.hidden,
        "num_attention_heads": cand.heads,
        "num_key_value_heads": cand.kv_heads,
        "ffn": cand.ffn,
        "dropped_blocks": list(cand.dropped),
    }


# --------------------------------------------------------------------------- checkpoint


def write_checkpoint(
    model: Any, tokenizer: Any, space: SearchSpace, ranking: Ranking, arch: Architecture, out: Path, ids: torch.Tensor, card: str
) -> str:
    """The pruned checkpoint through the export's own code (slicing, DeciLM/Llama format, verification); returns the format."""
    from autocompress.checkpoints.slicing import write_weights
    from autocompress.checkpoints.verification import verify_export
    from autocompress.io import staged

    with staged(out, overwrite=True) as tmp:
        fmt = write_weights(model, arch, ranking, tmp)
        model.generation_config.save_pretrained(tmp)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        check, _, _ = verify_export(tmp, model, space, ranking, arch, ids)
        (tmp / "README.md").write_text(
            card + f"\n\nVerified: max |logit difference| from the masked model {check.max_abs_logit_diff:.3g}.\n", encoding="utf-8"
        )
    return fmt
