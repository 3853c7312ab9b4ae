"""What a sweep computes once before its trials: model, space, cost model, absolute constraints, shared tensors."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from autocompress.arch.importance import importance as block_importance
from autocompress.arch.importance import rank_units, teacher_hidden
from autocompress.arch.masking import MaskedModel
from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.metrics import Constraint
from autocompress.config.schema import RunSpec, Scenario
from autocompress.cost import CostModel, get_cost_model
from autocompress.errors import ConfigError, InfeasibleError
from autocompress.io import Clock, RunPaths, log
from autocompress.model.base import BaseModel, load_base_model
from autocompress.model.data import load_token_data
from autocompress.search.differentiable import SearchInputs, evaluate, fill, flat_logits, teacher_perplexity
from autocompress.search.rival import best_homogeneous, homogeneous_full_kv


class PreparedRun(Protocol):
    """What every model family's prepare stage returns (config/families.py), as the sweep driver uses it."""

    base_costs: dict[str, float]
    base_perplexity: float

    @property
    def inputs(self) -> Any: ...  # the trials' inputs; .constraints: the absolute bounds

    def start(self, run: RunPaths) -> dict[str, Any]: ...  # a new run: its files, its metadata's model facts

    def reopen(self, run: RunPaths) -> None: ...  # a resumed run: what its trials used


@dataclass
class Prepared:
    base: BaseModel
    space: SearchSpace
    cost_model: CostModel
    base_costs: dict[str, float]
    base_perplexity: float  # report-split perplexity of the unpruned model (the tokens trials report on)
    inputs: SearchInputs
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # per preparation stage (Clock)

    # what every family's prepare stage returns (config/families.py): base_costs, base_perplexity, inputs.constraints,
    # and these two, which keep the run folder's family-specific files

    def start(self, run: RunPaths) -> dict[str, Any]:
        """A new run: write what its trials and export read (the unit ranking); its metadata's model facts."""
        self.inputs.ranking.save(run.ranking_file)  # export slices weights in this order
        return {
            "prepare_seconds": self.seconds,
            "cost_model": self.cost_model.describe(),
            "base_params": self.space.base.num_params(),
            "base_architecture": self.space.base.to_json(),
        }

    def reopen(self, run: RunPaths) -> None:
        """A resumed run: its trials go on with the ranking the run started with."""
        from autocompress.arch.masking import Ranking

        if not run.ranking_file.exists():
            raise ConfigError(f"{run.path} holds no {run.ranking_file.name}; this run cannot be resumed, start a new one")
        saved = Ranking.load(run.ranking_file)
        # the rival's selection KL was measured under the fresh ranking: trials measure it again under another one
        select = self.inputs.homogeneous_select if saved.same_as(self.inputs.ranking) else None
        self.inputs = dataclasses.replace(self.inputs, ranking=saved, homogeneous_select=select)


def resolve_constraints(scenario: Scenario, space: SearchSpace, cost_model: CostModel) -> tuple[tuple[Constraint, ...], dict[str, float]]:
    """Absolute constraints; raises InfeasibleError if even the smallest architecture misses one."""
    base_costs = cost_model.predict(space.largest())
    constraints = tuple(c.resolve(base_costs) for c in scenario.constraints)
    floor = cost_model.predict(space.smallest())
    for raw, c in zip(scenario.constraints, constraints, strict=True):
        if not c.satisfied(floor[c.metric]):
            raise InfeasibleError(
                f"constraint {raw.describe()} (= {c.value:.4g}) of scenario {scenario.name!r} cannot be met: "
                f"the smallest architecture in the search space reaches {c.metric} = {floor[c.metric]:.4g} "
                f"(base model: {base_costs[c.metric]:.4g}). Loosen the constraint or widen the space (search.space.*)"
            )
    return constraints, base_costs


def constraints_line(scenario: Scenario, constraints: tuple[Constraint, ...], base_costs: dict[str, float]) -> str:
    """One line: each bound as configured, its absolute value, and the unpruned model's predicted cost beside it."""
    parts = []
    for raw, c in zip(scenario.constraints, constraints, strict=True):
        met = "met" if c.satisfied(base_costs[c.metric]) else "missed"
        parts.append(f"{raw.describe()} -> {c.value:.4g} (base model {base_costs[c.metric]:.4g}: {met})")
    return "constraints: " + ", ".join(parts)


def check_positions(seq_len: int, config: Any, key: str) -> None:
    """ConfigError when windows of `seq_len` tokens are longer than the model has positions for (before any data is read)."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ConfigError(f"{key}={seq_len} is longer than the model's {limit} positions (max_position_embeddings); use <= {limit}")


def check_space(base: Architecture, space: SearchSpace) -> None:
    if space.largest() != base:
        raise InfeasibleError("the search space does not contain the base model; check search.space divisors")


RIVAL_MOVES = 64  # upgrades measured per fill step of the rival (SmolLM2 offers about 40)
RIVAL_SCREEN = 8  # selection sequences that screen the FFN widths; the RIVAL_KEEP best are measured on the whole split
RIVAL_KEEP = 3


def homogeneous_rival(
    model: Any, masked: MaskedModel, inputs: SearchInputs, cost_model: CostModel, sequences: int, probe_sequences: int
) -> tuple[Architecture, tuple[float, float]] | None:
    """The full-width homogeneous shape (every head, one FFN width, the fewest least important blocks dropped) that
    meets the constraints with the lowest selection-split KL, then filled up to the bounds: what every search's result
    must beat, with its selection (KL, perplexity) (None: none fits). The widths are screened on the first RIVAL_SCREEN
    selection sequences and the RIVAL_KEEP best measured on the whole split. The fill measures every upgrade (up to
    RIVAL_MOVES) by KL on `probe_sequences` calibration sequences, as a search's fill does, but ranks none by a
    search's distributions: there are none yet."""
    drop_order = block_importance(model, inputs.calib[:sequences], progress=False).drop_order()
    archs = homogeneous_full_kv(inputs.space, drop_order, cost_model, inputs.constraints)
    measured: dict[Architecture, tuple[float, float]] = {}

    def on_select(a: Architecture) -> float:
        measured[a] = evaluate(model, masked, a, inputs.select, inputs.teacher_select)
        return measured[a][0]

    head = inputs.select[:RIVAL_SCREEN], inputs.teacher_select[:RIVAL_SCREEN]
    screen = None if len(inputs.select) <= RIVAL_SCREEN else (lambda a: evaluate(model, masked, a, *head)[0])  # no cheaper estimate
    best = best_homogeneous(archs, on_select, screen, RIVAL_KEEP)
    if best is None:
        log("homogeneous rival: no full-width homogeneous shape meets the constraints")
        return None
    arch, kl = best
    kept = [b.ffn for b in arch.blocks if b.ffn]
    log(
        f"homogeneous rival: FFN {max(kept, default=0)} in {len(kept)} of {arch.num_layers} layers, "
        f"{arch.num_params() / 1e6:.1f}M parameters, selection KL {kl:.3f} ({len(archs)} FFN widths fit, "
        f"{len(measured)} measured on the whole selection split)"
    )
    space = inputs.space
    flat = tuple(flat_logits(space))  # no search's distributions rank the upgrades: every one is measured
    probe = inputs.calib[:probe_sequences], inputs.teacher_calib[:probe_sequences]
    filled, steps = fill(
        arch, space, cost_model, inputs.constraints, flat, lambda a: evaluate(model, masked, a, *probe)[0], 0.0, RIVAL_MOVES
    )
    if steps:
        on_select(filled)
        log(
            f"homogeneous rival filled by {steps} upgrades: {filled.num_params() / 1e6:.1f}M parameters, "
            f"selection KL {measured[filled][0]:.3f}"
        )
        if measured[filled][0] < kl:
            return filled, measured[filled]
    return arch, measured[arch]


def prepare(spec: RunSpec, progress: bool = True, on_checked: Callable[[], Any] | None = None) -> Prepared:
    """Load the base model, build space and cost model, resolve constraints, cache teacher outputs.

    `on_checked` is called once the model, space, cost model and constraints are known to be valid,
    before the data and the teacher's outputs (the long part): the sweep starts Ray there.
    """
    start = time.time()
    clock = Clock()
    base_model = load_base_model(spec.model)
    clock.lap("model")  # converting the embedded checkpoint on first use, then loading it
    check_positions(spec.data.seq_len, base_model.model.config, "data.seq_len")
    base = Architecture.from_llama_config(base_model.model.config)
    space = SearchSpace.from_base(base, spec.search.space)
    check_space(base, space)
    cost_model = get_cost_model(space, spec.scenario, spec.results_dir, spec.cost_model)
    constraints, base_costs = resolve_constraints(spec.scenario, space, cost_model)
    log(
        f"base model {spec.model.name}: {base.num_params():,} parameters, {base.num_layers} layers; "
        f"space of {space.size():.3g} architectures; cost model {cost_model.id}"
    )
    log(constraints_line(spec.scenario, constraints, base_costs))
    if all(c.satisfied(base_costs[c.metric]) for c in constraints):
        log(
            "warning: the unpruned model already meets every bound under this cost model; pruning buys nothing here. "
            "Tighten scenario.constraints (e.g. a 0.7x share of the base) or check the hardware and workload"
        )
    clock.lap("space")  # space, cost model, bounds
    data = load_token_data(spec.data, base_model.tokenizer)
    clock.lap("text")
    log(f"calibration text ({spec.data.source}): {data.summary()}")
    if on_checked is not None:
        on_checked()
    model = base_model.model
    ranking = rank_units(model, data.calib[: spec.search.importance_sequences], progress=progress)
    clock.lap("importance")
    calib_hidden = teacher_hidden(model, data.calib, progress=progress, desc="teacher (calibration)")
    select_hidden = teacher_hidden(model, data.select, progress=progress, desc="teacher (selection)")
    report_hidden = teacher_hidden(model, data.report, progress=progress, desc="teacher (report)")
    clock.lap("teacher")
    inputs = SearchInputs(
        space=space,
        ranking=ranking,
        calib=data.calib,
        select=data.select,
        report=data.report,
        teacher_calib=calib_hidden.to(torch.float32),
        teacher_select=select_hidden.to(torch.float32),
        teacher_report=report_hidden.to(torch.float32),
        constraints=constraints,
    )
    masked = MaskedModel(model, space, ranking)
    base_ppl = teacher_perplexity(model, data.report, report_hidden)
    clock.lap("base_eval")
    if spec.search.homogeneous_candidate:
        rival = homogeneous_rival(model, masked, inputs, cost_model, spec.search.importance_sequences, spec.search.probe_sequences)
        if rival is not None:
            inputs.homogeneous, inputs.homogeneous_select = rival
    masked.remove()
    clock.lap("rival")  # the homogeneous rival (search.homogeneous_candidate)
    log(f"prepared in {time.time() - start:.0f}s ({clock}); base model report-split perplexity {base_ppl:.2f}")
    return Prepared(base_model, space, cost_model, base_costs, base_ppl, inputs, clock.seconds)
