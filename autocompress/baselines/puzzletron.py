"""The Puzzletron baseline as NVIDIA Model Optimizer 0.47 runs it (`modelopt/torch/puzzletron/`) on a Llama-family model.

Steps, each as ModelOpt does it (read from its source and `examples/puzzletron/configs/`; own code):
1. Activation scoring on the calibration split (micro batch 4): FFN channels by its `IterativeChannelContributionHook`
   at the down projection's input: per batch, every not yet pruned channel i scores the mean over tokens of
   ||s + a_i W[:, i]||, the output error against the full output were i also removed (s = y - y_pruned so far); the
   batch's lowest-scoring share of channels is pruned next, so the batches spread the whole ranking
   (`get_pruning_schedule`). FFN variants keep the best channels (`mlp_init_mode: PruneByActivationsLog`).
2. Replacement library per layer: every attention option x every FFN option (`_construct_blocks_from_subblocks`):
   attention kept with the base KV heads, with fewer KV heads (attn_pruning's `n_heads_in_group_list`: the search
   space's KV options) or no-op; FFN at every width of the search space's grid (as fine as AutoCompress's choices) or
   no-op. KV heads are mean-pooled in consecutive groups (`gqa_init_mode: AverageKV`, ModelOpt's default, the init the
   search and the export use); the `PruneKVHeads` mode that attn_pruning.yaml names, which keeps the best KV heads and
   zeroes the other groups' query heads, is not built here. Hidden size is fixed: ModelOpt's hidden-dim pruning
   branch is commented out of its pipeline. Layer 0 keeps its attention (vLLM 0.32 cannot serve a DeciLM without it).
3. One-block replacement scores: the unpruned model with exactly one layer's block replaced, on the selection split;
   default objective `cosine_embedding_loss_hidden_states`, per sequence 1 - cos of the flattened final hidden states
   against the teacher's, averaged (`kl` as an option). The teacher block scores 0.
4. Per-block costs from the project's cost model for the scenario's workload: the change one block makes alone
   (Puzzletron sums per-subblock statistics and adds the non-block part once). Throughput enters through its
   reciprocal, as Puzzletron turns `target_throughput` into a summed-runtime budget.
5. The MIP (`autocompress.baselines.mip`): one block per layer, the summed scores minimised under every bound.
6. Realise and judge under the full cost model. ModelOpt stops here; where the additive approximation overshoots a
   bound, this baseline tightens that bound by the overshoot and solves again (each solve recorded), so that its pick
   meets the same constraints as every other method's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from autocompress.arch.masking import MaskedModel, Ranking
from autocompress.arch.space import Architecture, Block, SearchSpace
from autocompress.baselines.mip import LinearBound, Program, solve
from autocompress.config.metrics import Constraint
from autocompress.cost import CostModel
from autocompress.errors import ConfigError, InfeasibleError
from autocompress.model.scores import kl_of_log_probs
from autocompress.search.differentiable import evaluate

LABEL = "Puzzletron (ModelOpt puzzletron: block library, one-block scores, MIP)"
OBJECTIVES = ("cosine", "kl")


@dataclass(frozen=True)
class PuzzletronSpec:
    """Puzzletron's settings (conf/compare/default.yaml, `compare.puzzletron`)."""

    objective: str = "cosine"  # MIP objective: cosine (cosine_embedding_loss_hidden_states, ModelOpt's default) | kl
    kv_variants: bool = True  # attn_pruning's fewer-KV-head options in the library (false: ffn_pruning's library only)
    score_sequences: int | None = 16  # selection-split sequences for the one-block scores (ModelOpt's Llama-3.1-8B runtime example: 16)
    batch_size: int = 4  # activation scoring's micro batch (ModelOpt's micro_batch_size)
    max_solves: int = 8  # MIP solves while the realised pick overshoots a bound
    time_limit: float = 60.0  # seconds per MIP solve (ModelOpt's max_seconds_per_solution)
    choices: int = 1  # the MIP's N best choices (each earlier one cut off), each scored on the selection split; the best kept

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"compare.puzzletron.objective={self.objective!r} is unknown; use one of {', '.join(OBJECTIVES)}")
        for key in ("score_sequences", "batch_size", "max_solves", "time_limit", "choices"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"compare.puzzletron.{key} must be > 0, got {value!r}")


# --------------------------------------------------------------------------- 1. activation scoring


def pruning_schedule(channels: int, iterations: int) -> list[int]:
    """How many channels each batch prunes: `channels` spread over `iterations`, the first ones taking one more."""
    q, r = divmod(channels, iterations)
    return [q + 1] * r + [q] * (iterations - r)


def channel_contribution(a: torch.Tensor, weight: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """[b, s, i] down-projection input, [e, i] weight, [i] bool -> [i]: mean over tokens of ||s + a_j W[:, j]||.

    s = y - y_kept is the output error of the channels pruned so far; the score is that error were channel j also
    removed, expanded as ||s||^2 + 2 a_j (s . W_j) + a_j^2 ||W_j||^2. Pruned channels score +inf.
    """
    a = a.flatten(0, -2).float()  # [t, i]
    w = weight.float()
    s = (a * pruned.float()) @ w.T  # [t, e]: the output the pruned channels contributed
    sq = s.pow(2).sum(-1, keepdim=True)  # [t, 1]
    cross = s @ w  # [t, i]: s . W_j
    norms = w.pow(2).sum(0)  # [i]
    score = torch.sqrt((sq + 2 * a * cross + a.pow(2) * norms).clamp_min(0) + 1e-8).mean(0)
    return score.masked_fill(pruned, math.inf)


@torch.no_grad()
def ffn_ranking(model: Any, calib: torch.Tensor, batch_size: int = 4, progress: bool = True) -> torch.Tensor:
    """[L, i] FFN neuron ids per layer, most important first, by the iterative channel contribution over `calib`'s batches."""
    layers = model.model.layers
    inter = model.config.intermediate_size
    batches = list(range(0, len(calib), batch_size))
    schedule = pruning_schedule(inter, len(batches))
    pruned = torch.zeros(len(layers), inter, dtype=torch.bool)
    order: list[list[int]] = [[] for _ in layers]
    step = {"n": 0}

    def hook(idx: int) -> Any:
        def on_input(module: Any, args: Any) -> None:
            n = schedule[step["n"]]
            score = channel_contribution(args[0], module.weight, pruned[idx])
            chosen = torch.topk(score, n, largest=False, sorted=True).indices
            pruned[idx, chosen] = True
            order[idx].extend(int(c) for c in chosen)

        return on_input

    handles = [layer.mlp.down_proj.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for start in tqdm(batches, desc="puzzletron activation scoring", disable=not progress):
            model.model(input_ids=calib[start : start + batch_size], use_cache=False)
            step["n"] += 1
    finally:
        for h in handles:
            h.remove()
    return torch.tensor([list(reversed(o)) for o in order], dtype=torch.long)  # last pruned = most important


# --------------------------------------------------------------------------- 2. library, 3. scores, 4. costs


def library(space: SearchSpace, kv_variants: bool = True) -> list[Block]:
    """Every block of the replacement library: attention options x FFN options (the base model's block included)."""
    base_kv = space.base.blocks[0].kv_heads
    attention = [k for k in space.attention if kv_variants or k in (0, base_kv)]
    return [Block(kv, ffn) for kv in attention for ffn in space.ffn]


def with_block(base: Architecture, layer: int, block: Block) -> Architecture:
    blocks = list(base.blocks)
    blocks[layer] = block
    return Architecture(**{**base.__dict__, "blocks": tuple(blocks)})


def allowed(space: SearchSpace, layer: int, block: Block) -> bool:
    return space.attention.index(block.kv_heads) >= space.attention_floor[layer]


def cosine_embedding_loss(hidden: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """[b, s, d] final hidden states -> [b]: 1 - cos(flattened sequence, the teacher's) (ModelOpt's cosine_embedding_loss_hidden_states)."""
    return 1 - F.cosine_similarity(hidden.flatten(1).float(), teacher.flatten(1).float(), dim=-1)


@torch.no_grad()
def layer_inputs(model: Any, tokens: torch.Tensor, batch_size: int = 4) -> list[torch.Tensor]:
    """Per layer, the unpruned model's residual stream entering it on `tokens`: [L] x [n, s, d]."""
    layers = model.model.layers
    seen: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(idx: int) -> Any:
        def on_input(module: Any, args: Any, kwargs: Any) -> None:
            seen[idx].append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach())

        return on_input

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for start in range(0, len(tokens), batch_size):
            model.model(input_ids=tokens[start : start + batch_size], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(x) for x in seen]


@torch.no_grad()
def replaced_hidden(
    model: Any, masked: MaskedModel, arch: Architecture, layer: int, prefix: torch.Tensor, batch_size: int = 4
) -> torch.Tensor:
    """Final hidden states [n, s, d] of `arch`, which differs from the unpruned model from `layer` on, started from the
    teacher's residual stream entering `layer` (`prefix`): the layers before it compute what the teacher computes."""
    inner = model.model
    layers = inner.layers
    masked.set_architecture(arch)
    inner.layers = torch.nn.ModuleList(list(layers)[layer:])  # each layer's masks were bound to it when attached
    try:
        out = [
            inner(inputs_embeds=prefix[i : i + batch_size], use_cache=False).last_hidden_state for i in range(0, len(prefix), batch_size)
        ]
    finally:
        inner.layers = layers
        masked.clear()
    return torch.cat(out)


def one_block_scores(
    model: Any,
    masked: MaskedModel,
    space: SearchSpace,
    blocks: list[Block],
    tokens: torch.Tensor,
    teacher: torch.Tensor,
    objective: str = "cosine",
    progress: bool = True,
) -> np.ndarray:
    """[L, B] score of the unpruned model with exactly layer l's block replaced by block b (the base block 0.0; inf where
    the layer may not take it): cosine embedding loss of the final hidden states, or KL of the next-token distributions."""
    base = space.base
    scores = np.full((base.num_layers, len(blocks)), np.inf)
    prefix = layer_inputs(model, tokens)
    with torch.no_grad():  # the teacher's next-token log-probabilities, once for every replacement
        logq = torch.log_softmax(model.lm_head(teacher.to(model.dtype)).float(), dim=-1) if objective == "kl" else None
    jobs = [(layer, b) for layer in range(base.num_layers) for b, block in enumerate(blocks) if allowed(space, layer, block)]
    for layer, b in tqdm(jobs, desc="puzzletron one-block scores", disable=not progress):
        if blocks[b] == base.blocks[layer]:
            scores[layer, b] = 0.0
            continue
        hidden = replaced_hidden(model, masked, with_block(base, layer, blocks[b]), layer, prefix[layer])
        if logq is not None:
            with torch.no_grad():
                logp = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)
            scores[layer, b] = float(kl_of_log_probs(logp, logq))
        else:
            scores[layer, b] = float(cosine_embedding_loss(hidden, teacher).mean())
    return scores


def linear(constraint: Constraint, value: float) -> float:
    """The additive form of a metric: as it is for an upper bound, its reciprocal (time per token) for a lower one."""
    return value if constraint.sense == "max" else 1.0 / value


def block_costs(
    cost_model: CostModel, space: SearchSpace, blocks: list[Block], constraints: tuple[Constraint, ...]
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """The base model's costs, and per constraint [L, B]: the change of its additive form when layer l takes block b alone."""
    base = space.base
    base_costs = cost_model.predict(base)
    deltas = {c.metric: np.zeros((base.num_layers, len(blocks))) for c in constraints}
    for layer in range(base.num_layers):
        for b, block in enumerate(blocks):
            if block == base.blocks[layer] or not allowed(space, layer, block):
                continue
            costs = cost_model.predict(with_block(base, layer, block))
            for c in constraints:
                deltas[c.metric][layer, b] = linear(c, costs[c.metric]) - linear(c, base_costs[c.metric])
    return base_costs, deltas


# --------------------------------------------------------------------------- 5. MIP, 6. realise and tighten


def block_shape(arch: Architecture) -> dict[str, Any]:
    """Per layer: attention KV heads ('-' = no-op) and FFN widths (0 = no-op), and how many layers keep each."""
    return {
        "attention": "".join(str(b.kv_heads) if b.kv_heads else "-" for b in arch.blocks),
        "ffn": [b.ffn for b in arch.blocks],
        "attention_layers": sum(1 for b in arch.blocks if b.kv_heads),
        "ffn_layers": sum(1 for b in arch.blocks if b.ffn),
    }


@dataclass
class PuzzletronResult:
    arch: Architecture
    ranking: Ranking
    blocks: list[Block]  # the library
    scores: np.ndarray  # [L, B] one-block scores
    solves: list[dict[str, Any]]  # per MIP solve: budgets, the realised costs, the overshoot per violated bound
    kl_select: float  # the pick's selection-split KL (the score every method's pick is compared on)
    perplexity_select: float
    costs: dict[str, float]
    settings: dict[str, Any] = field(default_factory=dict)
    others: list[tuple[Architecture, float]] = field(default_factory=list)  # the MIP's next best choices, realised alike,
    # with their selection-split KL (search(alternatives=N): the runner-up, compare.probe's candidates)

    def shape(self) -> dict[str, Any]:
        """What the pick did per layer: attention KV heads ('-' = no-op) and FFN widths (0 = no-op)."""
        return block_shape(self.arch)

    def table(self) -> pd.DataFrame:
        """One row per (layer, block) of the library: its one-block score."""
        rows = [
            {"layer": layer, "kv_heads": blk.kv_heads, "ffn": blk.ffn, "score": float(self.scores[layer, b])}
            for layer in range(self.scores.shape[0])
            for b, blk in enumerate(self.blocks)
            if np.isfinite(self.scores[layer, b])
        ]
        return pd.DataFrame(rows)


def realise(
    space: SearchSpace,
    blocks: list[Block],
    scores: np.ndarray,
    cost_model: CostModel,
    constraints: tuple[Constraint, ...],
    max_solves: int = 8,
    time_limit: float = 60.0,
    exclude: tuple[tuple[int, ...], ...] = (),
) -> tuple[Architecture, list[dict[str, Any]]]:
    """Solve the MIP, judge its pick with the full cost model, tighten each overshot bound by its overshoot, solve again.

    Returns the first pick that meets every constraint and the record of every solve; InfeasibleError after `max_solves`.
    `exclude`: block choices (an index into `blocks` per layer) the MIP may not return (the runner-up excludes the pick).
    """
    base = space.base
    base_costs, deltas = block_costs(cost_model, space, blocks, constraints)
    budgets = {c.metric: linear(c, c.value) - linear(c, base_costs[c.metric]) for c in constraints}
    solves: list[dict[str, Any]] = []
    for _ in range(max_solves):
        program = Program(scores, tuple(LinearBound(c.metric, deltas[c.metric], budgets[c.metric]) for c in constraints))
        choice, objective = solve(program, time_limit, exclude)
        arch = Architecture(**{**base.__dict__, "blocks": tuple(blocks[b] for b in choice)})
        costs = cost_model.predict(arch)
        additive = {m: float(sum(deltas[m][i, b] for i, b in enumerate(choice))) for m in budgets}
        overshoot = {}
        for c in constraints:
            if not c.satisfied(costs[c.metric]):
                over = linear(c, costs[c.metric]) - linear(c, c.value)  # > 0 in the additive form
                overshoot[c.metric] = costs[c.metric] / c.value - 1
                budgets[c.metric] -= over * (1 + 1e-6) + 1e-12
        solves.append(
            {
                "budgets": {m: float(v) for m, v in program_budgets(program).items()},
                "objective": objective,
                "additive": additive,
                "costs": costs,
                "overshoot": overshoot,
                "architecture": arch.to_json(),
            }
        )
        if not overshoot:
            return arch, solves
    bounds = ", ".join(c.describe() for c in constraints)
    raise InfeasibleError(f"Puzzletron's pick still overshoots {bounds} after {max_solves} MIP solves; raise compare.puzzletron.max_solves")


def program_budgets(program: Program) -> dict[str, float]:
    return {b.metric: b.budget for b in program.bounds}


def search(
    model: Any,
    space: SearchSpace,
    cost_model: CostModel,
    constraints: tuple[Constraint, ...],
    calib: torch.Tensor,
    select: torch.Tensor,
    teacher_select: torch.Tensor,
    spec: PuzzletronSpec,
    progress: bool = True,
    alternatives: int = 0,
) -> PuzzletronResult:
    """Puzzletron's pick: activation scoring on `calib`, one-block scores on `select` (teacher hidden states
    `teacher_select` [n, s, d]), the MIP under `constraints`, realised and tightened until it meets them. With
    `alternatives` N, also the N next best choices (the same MIP with every earlier choice cut off, realised alike)."""
    base = space.base
    ranking = Ranking(hidden=torch.arange(base.hidden_size), ffn=ffn_ranking(model, calib, spec.batch_size, progress))
    blocks = library(space, spec.kv_variants)
    tokens, teacher = select[: spec.score_sequences], teacher_select[: spec.score_sequences]
    masked = MaskedModel(model, space, ranking)
    try:
        scores = one_block_scores(model, masked, space, blocks, tokens, teacher, spec.objective, progress)
        arch, solves = realise(space, blocks, scores, cost_model, constraints, spec.max_solves, spec.time_limit)
        kl, ppl = evaluate(model, masked, arch, select, teacher_select)
        others: list[tuple[Architecture, float]] = []
        cut = [tuple(blocks.index(b) for b in arch.blocks)]
        for _ in range(alternatives):
            try:
                other, _ = realise(space, blocks, scores, cost_model, constraints, spec.max_solves, spec.time_limit, tuple(cut))
            except InfeasibleError:  # no other choice meets the bounds
                break
            others.append((other, evaluate(model, masked, other, select, teacher_select)[0]))
            cut.append(tuple(blocks.index(b) for b in other.blocks))
    finally:
        masked.remove()
    if not math.isfinite(kl):
        raise InfeasibleError("Puzzletron's pick gives a non-finite selection-split KL")
    settings = {"objective": spec.objective, "kv_variants": spec.kv_variants, "library": len(blocks), "hidden_size": base.hidden_size}
    return PuzzletronResult(arch, ranking, blocks, scores, solves, kl, ppl, cost_model.predict(arch), settings, others)
