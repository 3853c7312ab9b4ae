"""What every compare stage shares (the run, its spec and trial, the base model, space, cost model, constraints,
calibration tokens) and how compare picks AutoCompress's trial; Llama-family and hybrid-MoE runs alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from autocompress.baselines.comparison import CompareJob
from autocompress.config.families import HYBRID_MOE, LLAMA, family
from autocompress.config.metrics import Constraint
from autocompress.config.schema import RunSpec
from autocompress.errors import ConfigError
from autocompress.results.store import Run, load_run, selection_quality


@dataclass
class Context:
    """What every stage shares: the run, its spec and trial, the base model, space, cost model, constraints, calibration tokens."""

    run: Run
    spec: RunSpec
    row: dict[str, Any]  # the AutoCompress trial
    model: Any  # the unpruned model (teacher), fp32, frozen
    tokenizer: Any
    space: Any  # SearchSpace
    cost_model: Any  # CostModel
    constraints: tuple[Constraint, ...]  # absolute, as the sweep resolved them
    data: Any  # TokenData of the run's calibration source
    family: str = LLAMA  # the trials' family: llama (dense) or granitemoehybrid (autocompress.baselines.minitron_moe)
    base_arch: Any = None  # the unpruned model's architecture (dense: space.base)
    base_path: str = "base"  # what evaluate loads as the unpruned model

    @property
    def hybrid(self) -> bool:
        """Not a per-layer Llama-family run (hybrid MoE, or any family registered without per_layer): compare leaves out
        what needs one (the probe, engine measurement, Puzzletron and the naive baselines)."""
        return not family(self.family).per_layer


def pick_trial(trials: pd.DataFrame, trial: str | None, run_dir: Path) -> dict[str, Any]:
    """The requested trial, or the feasible finished trial with the lowest selection-split KL (`kl_select`; `kl` in older runs)."""
    ok = trials[(trials["status"] == "ok") & trials["feasible"]]
    if trial is not None:
        rows = trials[trials["trial_id"] == trial]
        if rows.empty:
            raise ConfigError(f"compare.trial={trial} is not in {run_dir}/trials.parquet; its trials: {', '.join(trials['trial_id'])}")
        if trial not in set(ok["trial_id"]):
            raise ConfigError(f"compare.trial={trial} failed or misses a constraint; both models must meet the constraint")
        return dict(rows.iloc[0])
    if ok.empty:
        raise ConfigError(f"{run_dir} has no feasible trial; run more searches (sweep.num_trials) or loosen the constraints")
    quality = selection_quality(ok)  # runs made before the split: kl
    return dict(ok.loc[ok[quality].idxmin()])


def top_trials(trials: pd.DataFrame, n: int) -> pd.DataFrame:
    """The feasible finished trials with the `n` lowest selection-split KLs, one per architecture (compare.probe's candidates)."""
    ok = trials[(trials["status"] == "ok") & trials["feasible"]]
    quality = selection_quality(ok)
    return ok.sort_values([quality, "trial_id"]).drop_duplicates("architecture").head(n)


def cost_model_choice(configured: str, judged_by: str) -> str:
    """The cost model a run's trials were judged by: `auto` that meant the analytic model then (no fit existed for the
    hardware, e.g. before the GPU fits shipped in the package) still means it for that run."""
    return "analytic" if configured == "auto" and judged_by.startswith("analytic/") else configured


def splits(job: CompareJob) -> tuple[str, ...]:
    """The token splits compare reads: the held-out test split only when compare.test_split asks (the headline)."""
    from autocompress.model.data import SPLITS, TEST

    return (*SPLITS, TEST) if job.compare.test_split else tuple(SPLITS)


def build_context(job: CompareJob, run_dir: Path) -> Context:
    """The compared trial's run, checked against the command's scenario, and its family's context (compare stage)."""
    run = load_run(run_dir)
    spec = run.spec or job.spec
    if spec.scenario.name != job.spec.scenario.name:
        raise ConfigError(f"compare.run={run_dir} is a run of scenario {spec.scenario.name!r}, not {job.spec.scenario.name!r}")
    row = pick_trial(run.trials, job.compare.trial, run_dir)
    context: Context = family(row.get("family")).stage("compare")(job, run, spec, row)  # the trial's family's seam
    return context


def llama_context(job: CompareJob, run: Run, spec: RunSpec, row: dict[str, Any]) -> Context:
    """The Llama family's compare stage: the base model, the run's space and cost model (checked against the one that
    judged its trials), the absolute constraints and the text splits compare reads."""
    from autocompress.arch.space import Architecture, SearchSpace
    from autocompress.cost import get_cost_model
    from autocompress.model.base import load_base_model
    from autocompress.model.data import load_token_data

    base = load_base_model(spec.model)
    space = SearchSpace.from_base(Architecture.from_llama_config(base.model.config), spec.search.space)
    cost_model = get_cost_model(space, spec.scenario, spec.results_dir, cost_model_choice(spec.cost_model, str(row["cost_model"])))
    if cost_model.id != row["cost_model"]:
        raise ConfigError(
            f"the run's trials were judged by cost model {row['cost_model']}, but {cost_model.id} resolves now; "
            f"rerun the sweep, or pin the cost model with cost_model=PATH"
        )
    constraints = tuple(Constraint(c.metric, c.value) for c in run.constraints.values())
    data = load_token_data(spec.data, base.tokenizer, splits=splits(job))
    return Context(run, spec, row, base.model, base.tokenizer, space, cost_model, constraints, data, base_arch=space.base)


def hybrid_context(job: CompareJob, run: Run, spec: RunSpec, row: dict[str, Any]) -> Context:
    """The context of a hybrid-MoE run: its base checkpoint, the sweep's hybrid roofline (checked against the trial's figures)."""
    import math

    from autocompress.arch.hybrid import HybridModel
    from autocompress.arch.moe_pruning import MoEShape
    from autocompress.config.metrics import METRICS
    from autocompress.cost.hybrid import HybridCost, HybridCostModel, hardware_terms
    from autocompress.model.data import load_token_data
    from autocompress.search.moe import load_moe, model_path

    if job.compare.minitron.prune_kv_groups:
        raise ConfigError("compare.minitron.prune_kv_groups is an ablation for Llama-family models; drop it for a hybrid-MoE run")
    if job.compare.measure == "always":
        raise ConfigError("compare.measure=always: compare measures Llama-family models only; use auto or never for a hybrid-MoE run")
    if job.compare.probe.on:
        raise ConfigError("compare.probe.candidates: the probe picks among Llama-family candidates only; drop it (off for hybrid-MoE)")
    path = model_path(spec)
    model, tokenizer = load_moe(path)
    hw, _ = hardware_terms(spec.scenario.hardware, spec.cost_model)
    layer_types = list(model.config.layer_types)
    cost_model = HybridCostModel(
        HybridCost(HybridModel.from_granite(model.config, name=spec.model.name), hw, spec.scenario.workload),
        layer_types,
        f"hybrid-analytic/{hw.name}",
    )
    if cost_model.id != row["cost_model"]:
        raise ConfigError(
            f"the run's trials were judged by cost model {row['cost_model']}, but {cost_model.id} resolves now; rerun the sweep"
        )
    costs = cost_model.predict(cost_model.arch(MoEShape.from_json(row["architecture"])))
    for metric in METRICS:
        if not math.isclose(costs[metric], float(row[metric]), rel_tol=1e-6):
            raise ConfigError(
                f"the hybrid roofline now predicts {metric}={costs[metric]:.6g} for trial {row['trial_id']}, the sweep recorded "
                f"{float(row[metric]):.6g}: the cost model changed since the sweep; rerun the sweep"
            )
    constraints = tuple(Constraint(c.metric, c.value) for c in run.constraints.values())
    data = load_token_data(spec.data, tokenizer, splits=splits(job))
    base_arch = cost_model.arch(MoEShape.of(model.config))
    return Context(
        run,
        spec,
        row,
        model,
        tokenizer,
        None,
        cost_model,
        constraints,
        data,
        family=HYBRID_MOE,
        base_arch=base_arch,
        base_path=path,
    )


def arch_of(ctx: Context, text: str) -> Any:
    """An architecture JSON of this run's family."""
    if ctx.hybrid:
        from autocompress.arch.moe_pruning import MoEShape

        return ctx.cost_model.arch(MoEShape.from_json(text))
    from autocompress.arch.space import Architecture

    return Architecture.from_json(text)


def pick_inputs(ctx: Context) -> dict[str, Any]:
    """What every baseline's pick depends on besides its own settings (part of its stage key)."""
    return {
        "cost_model": ctx.cost_model.id,
        "data": dataclasses.asdict(ctx.spec.data),
        "constraints": [dataclasses.asdict(c) for c in ctx.constraints],
    }


def test_key(ctx: Context) -> dict[str, Any]:
    """What a test-split score depends on besides the model: the data settings and the split's documents."""
    return {"data": dataclasses.asdict(ctx.spec.data), "documents": ctx.data.documents.get("test", [])}
