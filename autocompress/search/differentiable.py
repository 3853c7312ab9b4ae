"""One differentiable architecture search run: a plain function, callable (and tested) without Ray.

Every decision (global hidden width and query-head count; per layer attention and FFN option) has a learnable
categorical distribution, sampled with straight-through Gumbel-softmax at an annealed temperature.
The loss is the KL divergence from the unpruned teacher to the sampled student on calibration text,
plus sum_c lambda_c * g_c (+ 0.5 * rho * max(g_c, 0)^2), where g_c is the normalised violation of
constraint c by the expected cost under the current distributions; lambda_c >= 0 follows dual
ascent (or stays fixed when dual_lr = 0). Weights are frozen: only the architecture logits learn.
The most probable architecture is then repaired (downgraded until every bound holds) and filled
(upgraded into the slack left inside the margin-tightened bounds), each move chosen among the few
the final distributions favour by KL on `search.probe_sequences` calibration sequences. With
`search.homogeneous_candidate`, the best full-width homogeneous shape (prepared once per sweep) is
filled the same way and kept instead when its selection-split KL is lower (`SearchResult.origin`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from autocompress.arch.masking import MaskedModel, Ranking
from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.metrics import Constraint
from autocompress.config.schema import LagrangianSettings, SearchSpec
from autocompress.cost import ArchDistribution, CostModel
from autocompress.io import Clock
from autocompress.model.scores import kl_of_log_probs, next_token_nll


@dataclass
class SearchInputs:
    """What every search of a sweep shares; computed once by the driver."""

    space: SearchSpace
    ranking: Ranking
    calib: torch.Tensor  # [n, s] token ids: the search's distillation loss
    select: torch.Tensor  # [m, s] selection split: what picks among trials (kl_select)
    report: torch.Tensor  # [r, s] report split: the kl / perplexity that are reported
    teacher_calib: torch.Tensor  # [n, s, d] teacher final-norm hidden states
    teacher_select: torch.Tensor  # [m, s, d]
    teacher_report: torch.Tensor  # [r, s, d]
    constraints: tuple[Constraint, ...]  # absolute bounds
    homogeneous: Architecture | None = None  # best full-width homogeneous shape (selection KL): each search's rival, filled alike
    homogeneous_select: tuple[float, float] | None = None  # its selection-split (KL, perplexity): trials that leave it unchanged reuse them


SEARCH_PHASES = ("steps", "repair", "fill", "rival", "score")  # where a trial's seconds go (trials.parquet: <phase>_s)


@dataclass
class SearchResult:
    architecture: Architecture
    costs: dict[str, float]
    feasible: dict[str, bool]  # per constraint metric
    kl: float  # report split: KL(teacher || student), nats per token, no retraining
    perplexity: float  # report split: perplexity of the student
    repair_steps: int  # downgrades applied after the search to meet the constraints
    wall_s: float
    fill_steps: int = 0  # upgrades applied after repair into the slack left under the (margin-tightened) bounds
    settle_steps: int = 0  # extra steps taken after the schedule because the argmax missed a bound
    repaired: Architecture | None = None  # after repair, before fill
    logits: tuple[torch.Tensor, ...] = ()  # the final architecture logits (hidden, attention, FFN, query heads)
    argmax: Architecture | None = None  # the most probable architecture before repair
    history: list[dict[str, float]] = field(default_factory=list)
    kl_select: float = math.nan  # selection split: KL(teacher || student), what picks among trials
    perplexity_select: float = math.nan  # selection split: perplexity of the student
    origin: str = "search"  # "homogeneous" when the filled homogeneous rival had the lower selection KL and was kept
    searched: Architecture | None = None  # the search's own result (repaired, filled), kept or not
    searched_kl_select: float = math.nan  # its selection-split KL
    seconds: dict[str, float] = field(default_factory=dict)  # per phase: steps, repair, fill, rival, score

    @property
    def all_feasible(self) -> bool:
        return all(self.feasible.values())


def violation(constraint: Constraint, value: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Normalised violation g: > 0 when violated. Upper bound b: value / (b (1 - m)) - 1; lower: 1 - value / (b (1 + m))."""
    bound = constraint.tightened(margin).value
    if constraint.sense == "max":
        return value / bound - 1
    return 1 - value / bound


def feasibility(constraints: tuple[Constraint, ...], costs: dict[str, float]) -> dict[str, bool]:
    return {c.metric: c.satisfied(costs[c.metric]) for c in constraints}


def relaxed_sample(logits: torch.Tensor, tau: float, gen: torch.Generator, hard: bool) -> torch.Tensor:
    """Gumbel-softmax sample at temperature tau; `hard`: one-hot forward with the relaxed gradient (straight-through)."""
    u = torch.rand(logits.shape, generator=gen).clamp_(1e-10, 1 - 1e-10)
    soft = torch.softmax((logits - torch.log(-torch.log(u))) / tau, dim=-1)
    if not hard:
        return soft
    one_hot = F.one_hot(soft.argmax(-1), logits.shape[-1]).to(soft.dtype)
    return one_hot - soft.detach() + soft


def kl_to_teacher(model: Any, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(p_teacher || p_student), both from the shared LM head."""
    return _kl(torch.log_softmax(model.lm_head(student_hidden).float(), dim=-1), model, teacher_hidden)


def _kl(logp_s: torch.Tensor, model: Any, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(p_teacher || p_student) from the student's log-probabilities [b, s, V]."""
    with torch.no_grad():
        logp_t = torch.log_softmax(model.lm_head(teacher_hidden).float(), dim=-1)
    return kl_of_log_probs(logp_s, logp_t)


@torch.no_grad()
def evaluate(
    model: Any, masked: MaskedModel, arch: Architecture | None, tokens: torch.Tensor, teacher: torch.Tensor, batch_size: int = 4
) -> tuple[float, float]:
    """Held-out (KL to teacher, perplexity) of `arch` (None = the unpruned model) without retraining."""
    if arch is None:
        masked.clear()
    else:
        masked.set_architecture(arch, skip_dropped=True)
    kl_sum, nll_sum, n_kl, n_nll = 0.0, 0.0, 0, 0
    try:
        for start in range(0, len(tokens), batch_size):
            ids = tokens[start : start + batch_size]
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
            logp = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)  # one LM head pass serves KL and perplexity
            kl_sum += float(_kl(logp, model, teacher[start : start + batch_size])) * ids.numel()
            nll_sum += next_token_nll(logp, ids)
            n_kl, n_nll = n_kl + ids.numel(), n_nll + ids[:, 1:].numel()
    finally:
        masked.clear()
    return kl_sum / n_kl, math.exp(nll_sum / n_nll)


@torch.no_grad()
def teacher_perplexity(model: Any, tokens: torch.Tensor, teacher: torch.Tensor, batch_size: int = 4) -> float:
    """The unpruned model's perplexity on `tokens` from its cached final hidden states `teacher` (teacher_hidden, same
    batches): the LM head alone, where `evaluate(..., None, ...)` would run the whole model again for the same number."""
    nll_sum, n_nll = 0.0, 0
    for start in range(0, len(tokens), batch_size):
        ids = tokens[start : start + batch_size]
        nll_sum += next_token_nll(torch.log_softmax(model.lm_head(teacher[start : start + batch_size]).float(), dim=-1), ids)
        n_nll += ids[:, 1:].numel()
    return math.exp(nll_sum / n_nll)


def flat_logits(space: SearchSpace) -> list[torch.Tensor]:
    """Zero architecture logits of every decision: hidden [h], attention [L, a], FFN [L, f], query heads [q]."""
    n = space.num_layers
    shapes = [(len(space.hidden),), (n, len(space.attention)), (n, len(space.ffn)), (len(space.heads),)]
    return [torch.zeros(shape) for shape in shapes]


Move = tuple[int, list[int], list[int], int]  # option indices: hidden, attention per layer, FFN per layer, query heads


def _moves(idx: Move, logp: list[torch.Tensor], space: SearchSpace, step: int) -> list[tuple[Move, float]]:
    """Every single-decision move of `idx` by `step` (-1: one option down, +1: one up) the space allows,
    with the log-probability it gains under `logp` (negative: what a move gives up)."""
    h, att, ffn, q = idx
    moves: list[tuple[Move, float]] = []
    if 0 <= h + step < len(space.hidden):
        moves.append(((h + step, att, ffn, q), float(logp[0][h + step] - logp[0][h])))
    if 0 <= q + step < len(space.heads):
        moves.append(((h, att, ffn, q + step), float(logp[3][q + step] - logp[3][q])))
    for layer in range(len(att)):
        if space.attention_floor[layer] <= att[layer] + step < len(space.attention):
            a2 = att.copy()
            a2[layer] += step
            moves.append(((h, a2, ffn, q), float(logp[1][layer, a2[layer]] - logp[1][layer, att[layer]])))
        if 0 <= ffn[layer] + step < len(space.ffn):
            f2 = ffn.copy()
            f2[layer] += step
            moves.append(((h, att, f2, q), float(logp[2][layer, f2[layer]] - logp[2][layer, ffn[layer]])))
    return moves


def repair(
    arch: Architecture,
    space: SearchSpace,
    cost_model: CostModel,
    constraints: tuple[Constraint, ...],
    logits: tuple[torch.Tensor, ...],
    quality: Callable[[Architecture], float] | None = None,
    candidates: int = 8,
) -> tuple[Architecture, int]:
    """Downgrade one decision at a time until every constraint holds.

    Moves are ranked by the drop in total violation per unit of log-probability given up under the
    search's final distributions; with `quality` (KL on a few calibration sequences), the best
    `candidates` of them are measured and the one losing the least quality per unit of violation
    removed is taken (log-probabilities alone undervalue a global decision such as the hidden size).
    """
    logp = [torch.log_softmax(t.detach(), dim=-1) for t in logits]

    def total_violation(a: Architecture) -> float:
        costs = cost_model.predict(a)
        return sum(max(0.0, float(violation(c, torch.tensor(costs[c.metric])))) for c in constraints)

    idx: Move = space.indices(arch)
    current, steps = total_violation(arch), 0
    base_quality = quality(arch) if quality is not None and current > 1e-9 else 0.0
    while current > 1e-9:
        scored = []
        for move, logp_gain in _moves(idx, logp, space, -1):
            cost = -logp_gain  # the log-probability the downgrade gives up
            gain = current - total_violation(space.architecture(*move))
            if gain > 0:
                scored.append((gain / (max(cost, 0.0) + 1e-3), gain, move))
        if not scored:
            break
        scored.sort(key=lambda s: (s[0], s[1]), reverse=True)
        if quality is None:
            _, gain, move = scored[0]
        else:
            measured = [((quality(space.architecture(*m)) - base_quality) / g, g, m) for _, g, m in scored[:candidates]]
            _, gain, move = min(measured, key=lambda s: s[0])
            base_quality = quality(space.architecture(*move))
        idx, current, steps = move, current - gain, steps + 1
    return space.architecture(*idx), steps


def fill(
    arch: Architecture,
    space: SearchSpace,
    cost_model: CostModel,
    constraints: tuple[Constraint, ...],
    logits: tuple[torch.Tensor, ...],
    quality: Callable[[Architecture], float],
    margin: float = 0.0,
    candidates: int = 8,
) -> tuple[Architecture, int]:
    """Upgrade one decision at a time while every constraint, tightened by `margin`, still holds.

    The search meets its target with the expected cost of its distributions, not with their most
    probable architecture, so the argmax (or the repaired one) often lands well inside the target;
    this spends that slack. Among the upgrades that keep every target, the `candidates` the search's
    final distributions favour most are measured with `quality` (lower is better); the one gaining
    the most quality per unit of normalised cost it uses is taken. Stops when no upgrade fits or
    none of the measured ones improves quality. Returns the architecture and the upgrades applied.
    """
    logp = [torch.log_softmax(t.detach(), dim=-1) for t in logits]

    def usage(a: Architecture) -> list[float]:
        costs = cost_model.predict(a)
        return [float(violation(c, torch.tensor(costs[c.metric]), margin)) for c in constraints]

    idx: Move = space.indices(arch)
    now = usage(arch)
    if any(g > 0 for g in now):  # not inside its target: nothing to spend
        return arch, 0
    current, steps = quality(arch), 0
    while True:
        fitting = []
        for move, gain in _moves(idx, logp, space, +1):
            g = usage(space.architecture(*move))
            if all(v <= 0 for v in g):
                fitting.append((gain, move, sum(max(0.0, b - a) for a, b in zip(now, g, strict=True))))
        if not fitting:
            break
        fitting.sort(key=lambda f: f[0], reverse=True)
        measured = []
        for _, move, used in fitting[:candidates]:
            q = quality(space.architecture(*move))
            measured.append(((current - q) / (used + 1e-3), q, move))
        rate, q, move = max(measured, key=lambda m: m[0])
        if rate <= 0:
            break
        idx, current, now, steps = move, q, usage(space.architecture(*move)), steps + 1
    return space.architecture(*idx), steps


def run_search(
    model: Any,
    inputs: SearchInputs,
    cost_model: CostModel,
    spec: SearchSpec,
    settings: LagrangianSettings,
    on_step: Callable[[dict[str, float]], None] | None = None,
    progress: bool = False,
    kl_weight: float = 1.0,
) -> SearchResult:
    """Search one architecture for the given Lagrangian settings; weights stay frozen.

    `progress` shows a bar with loss, KL, multipliers and expected costs (off inside Ray trials).
    `kl_weight` scales the KL term (0 = a cost-only search: the baseline that ignores quality).
    """
    start = time.time()
    space, cons = inputs.space, inputs.constraints
    gen = torch.Generator().manual_seed(settings.seed)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    logits = flat_logits(space)
    first = space.indices(inputs.homogeneous) if spec.start == "rival" and inputs.homogeneous is not None else None
    for k, t in enumerate(logits):
        if first is None:
            t[..., -1] = spec.init_bias  # start at the base model
        else:  # start at the rival's choice of every decision
            rows = t.view(-1, t.shape[-1])
            rows[torch.arange(len(rows)), torch.tensor(first[k]).reshape(-1)] = spec.init_bias
        t.requires_grad_(True)
    opt = torch.optim.Adam(logits, lr=settings.lr)
    forbidden = torch.zeros(space.num_layers, len(space.attention))  # options below a layer's floor
    for layer, floor in enumerate(space.attention_floor):
        forbidden[layer, :floor] = -1e4

    def current() -> list[torch.Tensor]:
        return [logits[0], logits[1] + forbidden, logits[2], logits[3]]

    lambdas = torch.full((len(cons),), settings.lambda_init, dtype=torch.float64)
    masked = MaskedModel(model, space, inputs.ranking)
    history: list[dict[str, float]] = []
    try:

        def one_step(step: int, tau: float, hard: torch.Tensor | None = None) -> None:
            """One optimisation step; the multipliers follow the expected violation, or `hard` (the argmax's) when given."""
            nonlocal lambdas
            rows = torch.randint(len(inputs.calib), (spec.batch_size,), generator=gen)
            masked.set(*(relaxed_sample(t, tau, gen, spec.straight_through) for t in current()))
            hidden = model.model(input_ids=inputs.calib[rows], use_cache=False).last_hidden_state
            kl = kl_to_teacher(model, hidden, inputs.teacher_calib[rows])
            costs = cost_model.expected(ArchDistribution(*(torch.softmax(t, dim=-1) for t in current())))
            g = torch.stack([violation(c, costs[c.metric], settings.margin) for c in cons])
            penalty = (lambdas * g).sum() + 0.5 * settings.quadratic * torch.relu(g).pow(2).sum()
            loss = kl_weight * kl + penalty.float()
            opt.zero_grad()
            loss.backward()
            opt.step()
            lambdas = torch.clamp(lambdas + settings.dual_lr * (g.detach() if hard is None else hard), min=0.0)
            record = {"step": step, "tau": tau, "loss": float(loss.detach()), "kl": float(kl.detach())}
            record.update({f"lambda_{c.metric}": float(lam) for c, lam in zip(cons, lambdas, strict=True)})
            record.update({f"expected_{k}": float(v.detach()) for k, v in costs.items()})
            history.append(record)
            bar.set_postfix({k.removeprefix("expected_"): f"{v:.3g}" for k, v in record.items() if k not in ("step", "tau")}, refresh=False)
            if on_step is not None:
                on_step(record)

        def argmax_violation() -> torch.Tensor:
            """Per constraint, the violation of the real bound by the most probable architecture (0 where it holds)."""
            h, att, ffn, q = (t.detach().argmax(-1) for t in current())
            costs = cost_model.predict(space.architecture(int(h), att.tolist(), ffn.tolist(), int(q)))
            return torch.stack([violation(c, torch.tensor(costs[c.metric], dtype=torch.float64)) for c in cons]).clamp(min=0.0)

        clock = Clock()  # seconds per phase, for trials.parquet (where a trial's time goes)
        bar = tqdm(range(spec.steps), desc="search", disable=not progress, dynamic_ncols=True)
        for step in bar:
            one_step(step, settings.tau_start * (settings.tau_end / settings.tau_start) ** (step / max(1, spec.steps - 1)))
        settled = 0
        for group in opt.param_groups:  # Adam moves each logit by about lr per step, whatever the multipliers: a smaller step flips fewer
            group["lr"] = settings.lr * spec.settle_lr
        while settled < spec.settle_steps and bool((hard := argmax_violation()).gt(1e-9).any()):
            one_step(spec.steps + settled, settings.tau_end, hard)  # the argmax misses a bound: push on, at the final temperature
            settled += 1
        masked.clear()
        clock.lap("steps")  # the gradient steps and the settling ones
        final = current()
        h, att, ffn, q = (t.detach().argmax(-1) for t in final)
        arch = argmax = space.architecture(int(h), att.tolist(), ffn.tolist(), int(q))
        probe = inputs.calib[: spec.probe_sequences], inputs.teacher_calib[: spec.probe_sequences]  # the same for every candidate

        def quality(a: Architecture) -> float:
            return evaluate(model, masked, a, *probe)[0]

        arch, repairs = repair(arch, space, cost_model, cons, tuple(final), quality, spec.candidates)
        clock.lap("repair")
        repaired, fills = arch, 0
        if spec.fill:
            arch, fills = fill(arch, space, cost_model, cons, tuple(final), quality, settings.margin, spec.candidates)
        clock.lap("fill")
        kl_select, ppl_select = evaluate(model, masked, arch, inputs.select, inputs.teacher_select)
        clock.lap("score")
        searched, searched_kl, origin = arch, kl_select, "search"
        # The rival: the best homogeneous shape, prepared at the bounds themselves. A trial that aims `margin` inside
        # them (a cheaper point of the front) repairs it into the same tightened bounds first, so each trial's rival
        # competes at that trial's cost, and then spends its slack the same way.
        tight = tuple(c.tightened(settings.margin) for c in cons)
        rival, rival_moves = inputs.homogeneous, 0
        if rival is not None and settings.margin > 0:
            rival, rival_moves = repair(rival, space, cost_model, tight, tuple(final), quality, spec.candidates)
        if rival is not None and all(feasibility(tight, cost_model.predict(rival)).values()):
            rival_fills = 0
            if spec.fill:
                rival, rival_fills = fill(rival, space, cost_model, cons, tuple(final), quality, settings.margin, spec.candidates)
            if rival_moves == 0 and rival_fills == 0 and inputs.homogeneous_select is not None:
                rival_kl, rival_ppl = inputs.homogeneous_select  # the prepared rival, measured once for every trial
            else:
                rival_kl, rival_ppl = evaluate(model, masked, rival, inputs.select, inputs.teacher_select)
            if rival_kl < kl_select:
                arch, fills, kl_select, ppl_select, origin = rival, rival_fills, rival_kl, rival_ppl, "homogeneous"
        clock.lap("rival")
        kl_report, ppl_report = evaluate(model, masked, arch, inputs.report, inputs.teacher_report)
        clock.lap("score")
    finally:
        masked.remove()
    costs_final = cost_model.predict(arch)
    return SearchResult(
        architecture=arch,
        costs=costs_final,
        feasible=feasibility(cons, costs_final),
        kl=kl_report,
        perplexity=ppl_report,
        repair_steps=repairs,
        fill_steps=fills,
        settle_steps=settled,
        repaired=repaired,
        logits=tuple(t.detach() for t in final),
        wall_s=time.time() - start,
        history=history,
        argmax=argmax,
        kl_select=kl_select,
        perplexity_select=ppl_select,
        origin=origin,
        searched=searched,
        searched_kl_select=searched_kl,
        seconds=clock.seconds,
    )
