"""`python -m autocompress.compare +scenario=NAME`: AutoCompress against NVIDIA's pruning baselines at the same constraint.

`compare.methods` names them (default: autocompress, minitron and, for Llama-family runs, puzzletron); each baseline
is one `pick(context) -> Pick` in autocompress.baselines.interface.BASELINES.

Both architectures go through the same pipeline: the export's weight slicing (and its verification),
the same distillation budget from the same teacher on the same calibration text (once per seed in
`compare.seeds`), and the same evaluation (benchmark items, subset and seed). AutoCompress's
architecture is the sweep's feasible trial with the lowest selection-split KL (or `compare.trial`);
the sweep runs first unless `compare.run` names a finished one. Minitron's is the best by
selection-split KL of its top-k homogeneous candidates that meet the same absolute constraints under
the same cost model (autocompress.baselines.minitron, as ModelOpt's mcore_minitron). With
`compare.probe.candidates=N` both picks are made instead among each method's N best by selection-split
KL after a short distillation of each (autocompress.quality.probe; the Minitron paper's step; by default
N = 3 for Llama-family runs and off for hybrid-MoE runs; 0 = off). KL before distillation is reported on
the report split. The table reports the constraint, predicted (and, where the engine runs here,
measured) costs, parameters, each benchmark and the average (means over seeds), perplexities, and
AutoCompress minus Minitron with a 95% interval from a bootstrap over items and distillation seeds.
Every stage lands in the output folder and is reused when rerun with the same settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from autocompress.baselines.comparison import TITLES, CompareJob, Model, job_from_dict, markdown, model_row, paired_bootstrap
from autocompress.config.cliargs import hydra_entry
from autocompress.config.cliargs import task as hydra_task
from autocompress.config.metrics import Constraint
from autocompress.config.schema import RunSpec
from autocompress.errors import ConfigError
from autocompress.io import RUN_TRIALS, check_writable, log, write_json, write_parquet, write_text
from autocompress.quality.tasks import evaluation_paths
from autocompress.results.store import load_run

RECORDED = (  # what compare.json keeps of each baseline's <name>.json (what the pick recorded of its shape and choice)
    "label",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "attention",
    "ffn",
    "experts",
    "expert_ffn",
    "shared_ffn",
    "dropped_blocks",
    "limits",
    "blocks",
    "solves",
    "kl_select",
    "kl_report",
    "budget",
)

# --------------------------------------------------------------------------- stages, reused when their key is unchanged


class Stages:
    """stages.json in the output folder: stage -> the settings it was made with; a stage whose key and folder match is skipped."""

    def __init__(self, out: Path) -> None:
        self.path = out / "stages.json"
        self.done: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.seconds: dict[str, float | str] = {}

    def run(self, name: str, key: Any, target: Path, build_fn: Callable[[], object], shared: bool = False) -> None:
        """Build `target` unless it was built with `key`. A `shared` target (used by other runs too) keeps its key beside it."""
        key = json.loads(json.dumps(key, default=str))
        record = target.with_name(f"{target.name}.stage.json") if shared else None
        done = json.loads(record.read_text()) if record is not None and record.exists() else self.done.get(name)
        if done == key and target.exists():
            log(f"{name}: reusing {target}")
            self.seconds[name] = "reused"
            return
        start = time.time()
        build_fn()
        self.seconds[name] = time.time() - start
        self.done[name] = key
        write_json(self.done, self.path)
        if record is not None:
            write_json(key, record)
        log(f"{name}: {self.seconds[name]:.0f}s -> {target}")


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
    quality = "kl_select" if "kl_select" in ok and ok["kl_select"].notna().any() else "kl"  # runs made before the split: kl
    return dict(ok.loc[ok[quality].idxmin()])


def top_trials(trials: pd.DataFrame, n: int) -> pd.DataFrame:
    """The feasible finished trials with the `n` lowest selection-split KLs, one per architecture (compare.probe's candidates)."""
    ok = trials[(trials["status"] == "ok") & trials["feasible"]]
    quality = "kl_select" if "kl_select" in ok and ok["kl_select"].notna().any() else "kl"
    return ok.sort_values([quality, "trial_id"]).drop_duplicates("architecture").head(n)


def _probe_inputs(job: CompareJob, ctx: Context) -> dict[str, Any]:
    """What a probe's outcome depends on besides its candidates (its stage key)."""
    spec = ctx.spec
    dspec = job.compare.probe.distill_spec(job.distill)
    from autocompress.quality.distillation import seeded_identity

    key = {"probe": dataclasses.asdict(job.compare.probe), "distill": dataclasses.asdict(dspec), "data": dataclasses.asdict(spec.data)}
    return key | seeded_identity(dspec.seed)


def _run_probe(job: CompareJob, ctx: Context, writers: dict[str, Callable[[Path], object]], work: Path) -> list[dict[str, Any]]:
    from autocompress.quality.probe import probe

    forbid = (*evaluation_paths(), *evaluation_paths(job.evaluate.data_dir, job.evaluate.corpus))
    dspec = job.compare.probe.distill_spec(job.distill)
    try:
        return probe(writers, work, ctx.model, ctx.tokenizer, ctx.spec.data, dspec, ctx.data.select, forbid)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # whatever a failed candidate left


def autocompress_probe_stage(job: CompareJob, ctx: Context, candidates: pd.DataFrame, out: Path) -> None:
    """compare.probe for AutoCompress: its top trials exported, each distilled briefly and scored; probe.json."""
    from autocompress.checkpoints.pipeline import ExportRequest, export
    from autocompress.quality.probe import chosen

    trials = ctx.run.path / RUN_TRIALS

    def writer(trial: str) -> Callable[[Path], object]:
        return lambda folder: export(ExportRequest(trials, folder, trial=trial, overwrite=True))

    rows = _run_probe(job, ctx, {t: writer(t) for t in candidates["trial_id"]}, out.parent / ".probe")
    before = candidates.set_index("trial_id")
    quality = "kl_select" if "kl_select" in before and before["kl_select"].notna().any() else "kl"
    for r in rows:
        r["kl_select"] = float(before.loc[r["candidate"], quality])
        r["params"] = int(before.loc[r["candidate"], "params"])
    write_json({"chosen": chosen(rows), "candidates": rows, **_probe_inputs(job, ctx)}, out)


def _hash(data: Any) -> str:
    return hashlib.sha1(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:10]


# --------------------------------------------------------------------------- the pipeline


@dataclass
class Context:
    """What every stage shares: the run, its spec and trial, the base model, space, cost model, constraints, calibration tokens."""

    run: Any  # results.Run
    spec: RunSpec
    row: dict[str, Any]  # the AutoCompress trial
    model: Any  # the unpruned model (teacher), fp32, frozen
    tokenizer: Any
    space: Any  # SearchSpace
    cost_model: Any  # CostModel
    constraints: tuple[Constraint, ...]  # absolute, as the sweep resolved them
    data: Any  # TokenData of the run's calibration source
    family: str = "llama"  # the trials' family: llama (dense) or granitemoehybrid (autocompress.baselines.minitron_moe)
    base_arch: Any = None  # the unpruned model's architecture (dense: space.base)
    base_path: str = "base"  # what evaluate loads as the unpruned model

    @property
    def hybrid(self) -> bool:
        return self.family == "granitemoehybrid"


def resolve_run(job: CompareJob, config_yaml: str, stages: dict[str, float | str]) -> Path:
    if job.compare.run:
        return Path(job.compare.run)
    from autocompress.search.tune import run_sweep

    log("compare: running the sweep first (give compare.run=RUN_DIR to reuse a finished one)")
    start = time.time()
    run_dir = run_sweep(job.spec, config_yaml)
    stages["sweep"] = time.time() - start
    return run_dir


def _pick_context(job: CompareJob, ctx: Context, name: str, out: Path) -> Any:
    """What a baseline's pick sees (autocompress.baselines.interface.PickContext); compare.probe for one registered to use it."""
    from autocompress.arch.importance import teacher_hidden
    from autocompress.baselines.interface import BASELINES, PickContext, Probe

    select = ctx.data.select
    teacher = None if ctx.hybrid else teacher_hidden(ctx.model, select, desc="teacher (selection)")
    probe = None
    if BASELINES[name].probes and job.compare.probe.on:
        p = job.compare.probe
        described = f"the best {p.candidates} again after {p.tokens:,} distillation tokens each"
        probe = Probe(p.count, partial(_run_probe, job, ctx, work=out / ".probe"), described)
    return PickContext(
        ctx.model,
        ctx.space,
        ctx.cost_model,
        ctx.constraints,
        ctx.data.calib,
        select,
        teacher,
        family=ctx.family,
        tokenizer=ctx.tokenizer,
        check_ids=ctx.data.report[:4],
        probe=probe,
        runner_up=job.compare.runner_up,
    )


def baseline_stage(job: CompareJob, ctx: Context, name: str, out: Path) -> None:
    """A registered baseline's pick (autocompress.baselines.interface), its checkpoint, its tables and `<name>.json`."""
    from autocompress.arch.importance import teacher_hidden
    from autocompress.arch.masking import MaskedModel
    from autocompress.baselines.interface import BASELINES
    from autocompress.baselines.minitron import write_checkpoint
    from autocompress.search.differentiable import evaluate

    pick = BASELINES[name].pick(_pick_context(job, ctx, name, out), getattr(job.compare, name))
    report = ctx.data.report
    if pick.report is None or pick.write is None:  # the teacher sliced and masked by the pick's ranking
        if pick.ranking is None:
            raise TypeError(f"baseline {name!r}: a pick without a ranking must write its checkpoint and report its KL itself")
        ranking = pick.ranking
    if pick.report is not None:
        kl_report, ppl_report = pick.report(report)
    else:
        masked = MaskedModel(ctx.model, ctx.space, ranking)
        kl_report, ppl_report = evaluate(ctx.model, masked, pick.arch, report, teacher_hidden(ctx.model, report, desc="teacher (report)"))
        masked.remove()
    summary = pick.summary() | {"kl_report": kl_report, "perplexity_report": ppl_report}
    shape = pick.description or (
        f"Hidden {pick.arch.hidden_size}, attention per layer (KV heads, '-' = none) `{summary['attention']}`, "
        f"FFN widths {summary['ffn']}; {pick.arch.num_params():,} parameters; selection-split KL {pick.kl_select:.4f}"
    )
    title = f"# {ctx.spec.model.name}, pruned by the {pick.label} baseline for `{ctx.spec.scenario.name}`"
    card = f"{title}\n\n{shape}; cost model `{ctx.cost_model.id}`."
    out.mkdir(parents=True, exist_ok=True)
    if pick.write is not None:
        pick.write(out / "pruned", card)
    else:
        write_checkpoint(ctx.model, ctx.tokenizer, ctx.space, ranking, pick.arch, out / "pruned", report[:4], card)
    for table, frame in pick.tables.items():
        write_parquet(frame, out / f"{table}.parquet")
    second = pick.runner_up
    if second is not None:  # compare.runner_up: sliced, checked and recorded as the pick is
        if second.ranking is None:
            raise TypeError(f"baseline {name!r}: its runner-up has no ranking to slice by")
        masked = MaskedModel(ctx.model, ctx.space, second.ranking)
        kl2, ppl2 = evaluate(ctx.model, masked, second.arch, report, teacher_hidden(ctx.model, report, desc="teacher (report)"))
        masked.remove()
        summary["runner_up"] = second.summary() | {"kl_report": kl2, "perplexity_report": ppl2}
        card2 = f"# {ctx.spec.model.name}, the {pick.label} baseline's runner-up for `{ctx.spec.scenario.name}`"
        write_checkpoint(ctx.model, ctx.tokenizer, ctx.space, second.ranking, second.arch, out / "runner_up" / "pruned", report[:4], card2)
    write_json(summary, out / f"{name}.json")


def cost_model_choice(configured: str, judged_by: str) -> str:
    """The cost model a run's trials were judged by: `auto` that meant the analytic model then (no fit existed for the
    hardware, e.g. before the GPU fits shipped in the package) still means it for that run."""
    return "analytic" if configured == "auto" and judged_by.startswith("analytic/") else configured


def _splits(job: CompareJob) -> tuple[str, ...]:
    """The token splits compare reads: the held-out test split only when compare.test_split asks (the headline)."""
    from autocompress.model.data import SPLITS, TEST

    return (*SPLITS, TEST) if job.compare.test_split else tuple(SPLITS)


def test_stage(ctx: Context, path: str | Path | None, out: Path) -> None:
    """Test-split KL to the unpruned model and perplexity of a checkpoint (None: the unpruned model) (compare.test_split)."""
    from autocompress.model.checkpoint import load_checkpoint
    from autocompress.quality.distillation import heldout_scores

    assert ctx.data.test is not None  # loaded by _splits
    student = ctx.model if path is None else load_checkpoint(path, ctx.spec.model).model
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(heldout_scores(student, ctx.model, ctx.data.test), out)


def build_context(job: CompareJob, run_dir: Path) -> Context:
    """Base model, space, the run's cost model and absolute constraints, calibration tokens."""
    from autocompress.arch.space import Architecture, SearchSpace
    from autocompress.cost import get_cost_model
    from autocompress.model.base import load_base_model
    from autocompress.model.data import load_token_data

    run = load_run(run_dir)
    spec = run.spec or job.spec
    if spec.scenario.name != job.spec.scenario.name:
        raise ConfigError(f"compare.run={run_dir} is a run of scenario {spec.scenario.name!r}, not {job.spec.scenario.name!r}")
    row = pick_trial(run.trials, job.compare.trial, run_dir)
    if row.get("family") == "granitemoehybrid":
        return hybrid_context(job, run, spec, row)
    base = load_base_model(spec.model)
    space = SearchSpace.from_base(Architecture.from_llama_config(base.model.config), spec.search.space)
    cost_model = get_cost_model(space, spec.scenario, spec.results_dir, cost_model_choice(spec.cost_model, str(row["cost_model"])))
    if cost_model.id != row["cost_model"]:
        raise ConfigError(
            f"the run's trials were judged by cost model {row['cost_model']}, but {cost_model.id} resolves now; "
            f"rerun the sweep, or pin the cost model with cost_model=PATH"
        )
    constraints = tuple(Constraint(c.metric, c.value) for c in run.constraints.values())
    data = load_token_data(spec.data, base.tokenizer, splits=_splits(job))
    return Context(run, spec, row, base.model, base.tokenizer, space, cost_model, constraints, data, base_arch=space.base)


def hybrid_context(job: CompareJob, run: Any, spec: RunSpec, row: dict[str, Any]) -> Context:
    """The context of a hybrid-MoE run: its base checkpoint, the sweep's hybrid roofline (checked against the trial's figures)."""
    import math

    from autocompress.arch.hybrid import HybridModel
    from autocompress.arch.moe_pruning import MoEShape
    from autocompress.baselines.minitron_moe import HybridCostModel, shape_from_json
    from autocompress.config.metrics import METRICS
    from autocompress.cost.hybrid import HybridCost, hardware_terms
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
    costs = cost_model.predict(cost_model.arch(shape_from_json(row["architecture"])))
    for metric in METRICS:
        if not math.isclose(costs[metric], float(row[metric]), rel_tol=1e-6):
            raise ConfigError(
                f"the hybrid roofline now predicts {metric}={costs[metric]:.6g} for trial {row['trial_id']}, the sweep recorded "
                f"{float(row[metric]):.6g}: the cost model changed since the sweep; rerun the sweep"
            )
    constraints = tuple(Constraint(c.metric, c.value) for c in run.constraints.values())
    data = load_token_data(spec.data, tokenizer, splits=_splits(job))
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
        family="granitemoehybrid",
        base_arch=base_arch,
        base_path=path,
    )


def evaluate_stage(job: CompareJob, ctx: Context, path: str | Path, out: Path) -> None:
    from autocompress.model.checkpoint import load_checkpoint
    from autocompress.quality.evaluation import evaluate_model, write_result

    loaded = load_checkpoint(path, ctx.spec.model)
    write_result(evaluate_model(loaded.model, loaded.tokenizer, job.evaluate, name=str(out.parent.name)), out)


def measure_costs(job: CompareJob, ctx: Context, models: list[Model], out: Path, stages: Stages) -> str:
    """Measured costs in the serving engine where it runs here (or compare.measure=always), kept in measured.json; a note."""
    hw, wl = ctx.spec.scenario.hardware, ctx.spec.scenario.workload
    local = hw.engine == "vllm-cpu" and importlib.util.find_spec("vllm") is not None
    if ctx.hybrid:  # compare.measure=always was refused in hybrid_context
        return "not measured (compare measures Llama-family models in the engine; hybrid-MoE costs are the hybrid roofline's)"
    if job.compare.measure == "never" or (job.compare.measure == "auto" and not local):
        return "not measured" + ("" if job.compare.measure == "never" else f" (the engine for {hw.name} does not run on this machine)")
    path = out / "measured.json"
    key = {"workload": dataclasses.asdict(wl), "hardware": dataclasses.asdict(hw), "archs": [m.arch.to_json() for m in models]}
    stages.run("measure", key, path, partial(_measure, ctx, models, path))
    measured = json.loads(path.read_text())
    for m in models:
        m.measured = measured.get(m.name, {})
    return f"measured in {hw.engine} ({wl.name}, medians of 3 waves; memory = peak resident on a CPU, the device footprint on a GPU)"


def _measure(ctx: Context, models: list[Model], path: Path) -> None:
    from autocompress.cluster import init_ray
    from autocompress.cost.engine import measure_many, measured_metrics, require_vllm, settings_for

    hw, wl = ctx.spec.scenario.hardware, ctx.spec.scenario.workload
    require_vllm(hw.engine)
    settings = settings_for(ctx.spec.profile, hw, [wl], repeats=3, warmup=1)
    init_ray(ctx.spec.sweep.ray_address)
    names, measured = {m.arch.to_json(): m.name for m in models}, {}
    for arch, rows in measure_many([m.arch for m in models], ctx.model.config.to_dict(), [wl], settings):
        row, name = rows[0], names[arch.to_json()]
        if row.get("status") == "ok":
            measured[name] = measured_metrics(row)
        else:
            log(f"measuring {name} failed: {row.get('error')}")
    write_json(measured, path)


def _autocompress_model(job: CompareJob, ctx: Context, out: Path, stages: Stages) -> Model:
    """The AutoCompress trial (the probe's pick where it is on) through the export."""
    from autocompress.checkpoints.pipeline import ExportRequest, export

    if job.compare.probe.on and job.compare.trial is None:
        candidates = top_trials(ctx.run.trials, job.compare.probe.count)
        path = out / "autocompress" / "probe.json"
        key = {**_probe_inputs(job, ctx), "trials": candidates[["trial_id", "architecture"]].values.tolist()}
        stages.run("autocompress/probe", key, path, partial(autocompress_probe_stage, job, ctx, candidates, path))
        pick = json.loads(path.read_text())["chosen"]
        ctx.row = dict(candidates.set_index("trial_id", drop=False).loc[pick])
    row = ctx.row
    request = ExportRequest(ctx.run.path / RUN_TRIALS, out / "autocompress" / "pruned", trial=row["trial_id"], overwrite=True)
    stages.run(
        "autocompress/pruned", {"trial": row["trial_id"], "architecture": row["architecture"]}, request.out, partial(export, request)
    )
    arch = _arch(ctx, row["architecture"])
    return Model("autocompress", arch, ctx.cost_model.predict(arch), float(row["kl"]), label=str(row["trial_id"]))


def _arch(ctx: Context, text: str) -> Any:
    """An architecture JSON of this run's family."""
    if ctx.hybrid:
        from autocompress.baselines.minitron_moe import shape_from_json

        return ctx.cost_model.arch(shape_from_json(text))
    from autocompress.arch.space import Architecture

    return Architecture.from_json(text)


def _pick_inputs(ctx: Context) -> dict[str, Any]:
    """What every baseline's pick depends on besides its own settings (part of its stage key)."""
    return {
        "cost_model": ctx.cost_model.id,
        "data": dataclasses.asdict(ctx.spec.data),
        "constraints": [dataclasses.asdict(c) for c in ctx.constraints],
    }


def _baseline_model(job: CompareJob, ctx: Context, out: Path, stages: Stages, name: str) -> Model:
    """A baseline registered in autocompress.baselines.interface, through the same slicing."""
    from autocompress.baselines.interface import BASELINES

    baseline = BASELINES[name]
    key = {name: dataclasses.asdict(getattr(job.compare, name)), **(baseline.key() if baseline.key else {}), **_pick_inputs(ctx)}
    if baseline.probes and job.compare.probe.on:  # without it, keys made before the probe still match
        key["probe"] = _probe_inputs(job, ctx)
    if job.compare.runner_up:
        key["runner_up"] = True
    stages.run(f"{name}/pruned", key, out / name / "pruned", partial(baseline_stage, job, ctx, name, out / name))
    done = json.loads((out / name / f"{name}.json").read_text())
    arch = _arch(ctx, done["architecture"])
    label = done.get("table_label", done["label"])
    return Model(name, arch, ctx.cost_model.predict(arch), float(done["kl_report"]), label=label)


def _runner_ups(job: CompareJob, ctx: Context, out: Path, stages: Stages, models: list[Model]) -> list[Model]:
    """compare.runner_up: each method's second by its own selection score, through the same slicing (made with its pick)."""
    from autocompress.checkpoints.pipeline import ExportRequest, export

    seconds = []
    for m in models:
        if m.name == "autocompress":
            probed = out / "autocompress" / "probe.json"
            if job.compare.probe.on and job.compare.trial is None:  # the probe's second
                rows = sorted(json.loads(probed.read_text())["candidates"], key=lambda r: r["kl_select_probe"])
                trial = rows[1]["candidate"] if len(rows) > 1 else None
            else:  # the second trial by selection-split KL (one per architecture)
                top = top_trials(ctx.run.trials, 2)
                trial = next((t for t in top["trial_id"] if t != ctx.row["trial_id"]), None)
            if trial is None:
                log("compare.runner_up: AutoCompress has no second candidate; none distilled")
                continue
            row = dict(ctx.run.trials.set_index("trial_id", drop=False).loc[trial])
            request = ExportRequest(ctx.run.path / RUN_TRIALS, out / "autocompress" / "runner_up" / "pruned", trial=trial, overwrite=True)
            key = {"trial": trial, "architecture": row["architecture"]}
            stages.run("autocompress/runner_up/pruned", key, request.out, partial(export, request))
            arch = _arch(ctx, row["architecture"])
            seconds.append(Model("autocompress/runner_up", arch, ctx.cost_model.predict(arch), float(row["kl"]), label=str(trial)))
            continue
        done = json.loads((out / m.name / f"{m.name}.json").read_text()).get("runner_up")
        if done is None:
            log(f"compare.runner_up: {m.name} has no second candidate; none distilled")
            continue
        arch = _arch(ctx, done["architecture"])
        label = done.get("table_label", done["label"])
        seconds.append(Model(f"{m.name}/runner_up", arch, ctx.cost_model.predict(arch), float(done["kl_report"]), label=label))
    return seconds


def _models(job: CompareJob, ctx: Context, out: Path, stages: Stages) -> list[Model]:
    """Every method's pruned checkpoint, in compare.methods' order (AutoCompress first)."""
    models = [_autocompress_model(job, ctx, out, stages)]
    baselines = [name for name in job.compare.methods or ("autocompress", "minitron") if name != "autocompress"]
    return models + [_baseline_model(job, ctx, out, stages, name) for name in baselines]


def _distill_and_evaluate(job: CompareJob, ctx: Context, out: Path, stages: Stages, models: list[Model]) -> Model:
    """Distil and evaluate both models (same budget, same items); evaluate the unpruned model (cached across runs)."""
    from autocompress.quality.distillation import distill, seeded_identity
    from autocompress.quality.evaluation import read_result

    spec = ctx.spec
    forbid = (*evaluation_paths(), *evaluation_paths(job.evaluate.data_dir, job.evaluate.corpus))
    ekey = {"evaluate": dataclasses.asdict(job.evaluate), "model": dataclasses.asdict(spec.model)}
    for seed in job.compare.seeds:
        dspec = dataclasses.replace(job.distill, seed=seed)
        dkey: dict[str, Any] = {
            "distill": dataclasses.asdict(dspec),
            "data": dataclasses.asdict(spec.data),
            "teacher": dataclasses.asdict(spec.model),
        }
        dkey |= seeded_identity(seed)  # a seed's stage from before the fix was seed 0's model again
        for m in models:
            target, student = out / m.name / f"distilled-seed{seed}", out / m.name / "pruned"
            # the folder is compare's: a stale state from other settings (or a pre-73bc6e8 seed) is redone
            args = (student, target, ctx.model, ctx.tokenizer, spec.data, dspec)
            run = partial(distill, *args, overwrite=True, discard_stale=True, evaluation_dirs=forbid)
            stages.run(f"{m.name}/distilled-seed{seed}", {**dkey, "student": m.arch.to_json()}, target, run)
            m.distill.append(json.loads((target / "distill.json").read_text()))
            evaluated = out / m.name / f"eval-seed{seed}"
            key = {**ekey, **dkey, "student": m.arch.to_json()}
            stages.run(f"{m.name}/eval-seed{seed}", key, evaluated, partial(evaluate_stage, job, ctx, target, evaluated))
            m.results.append(read_result(evaluated))
            if job.compare.test_split:
                tested = out / m.name / f"test-seed{seed}.json"
                tkey = {**dkey, "student": m.arch.to_json(), "test": _test_key(ctx)}
                stages.run(f"{m.name}/test-seed{seed}", tkey, tested, partial(test_stage, ctx, target, tested))
                m.test.append(json.loads(tested.read_text()))
    base_eval = Path(spec.results_dir).resolve() / "evaluate" / f"base-{spec.model.name}-{_hash(ekey)}"
    stages.run("base/eval", ekey, base_eval, partial(evaluate_stage, job, ctx, ctx.base_path, base_eval), shared=True)
    base_arch = ctx.base_arch
    base = Model("base", base_arch, ctx.cost_model.predict(base_arch), 0.0, label="unpruned", results=[read_result(base_eval)])
    if job.compare.test_split:
        tested = out / "base" / "test.json"
        stages.run(
            "base/test",
            {"teacher": dataclasses.asdict(spec.model), "test": _test_key(ctx)},
            tested,
            partial(test_stage, ctx, None, tested),
        )
        base.test.append(json.loads(tested.read_text()))
    return base


def _test_key(ctx: Context) -> dict[str, Any]:
    """What a test-split score depends on besides the model: the data settings and the split's documents."""
    return {"data": dataclasses.asdict(ctx.spec.data), "documents": ctx.data.documents.get("test", [])}


def run_compare(job: CompareJob, config_yaml: str = "") -> Path:
    """The whole comparison; returns the output folder."""
    timings: dict[str, float | str] = {}
    run_dir = resolve_run(job, config_yaml, timings).resolve()
    load_run(run_dir)  # a finished sweep run, or one clear error before anything is written (no stray compare/ folder)
    out = Path(job.compare.out or run_dir / "compare").resolve()
    check_writable(out, "compare.out")
    start = time.time()
    ctx = build_context(job, run_dir)  # refusals (scenario, trial, cost model) come before the output folder exists
    out.mkdir(parents=True, exist_ok=True)
    stages = Stages(out)
    probe = job.compare.probe.resolved(ctx.hybrid)  # the default: on for a Llama-family run, off for a hybrid-MoE one
    methods = job.compare.resolved_methods(ctx.hybrid)
    job = dataclasses.replace(job, compare=dataclasses.replace(job.compare, probe=probe, methods=methods))
    timings["prepare"] = time.time() - start
    models = _models(job, ctx, out, stages)
    seconds = _runner_ups(job, ctx, out, stages, models) if job.compare.runner_up else []
    base = _distill_and_evaluate(job, ctx, out, stages, [*models, *seconds])
    note = measure_costs(job, ctx, [base, *models], out, stages)
    timings |= stages.seconds
    write_outputs(job, ctx, out, [base, *models], note, timings, seconds)
    return out


def write_outputs(
    job: CompareJob, ctx: Context, out: Path, models: list[Model], note: str, timings: dict[str, Any], seconds: list[Model] | None = None
) -> None:
    """compare.parquet (one row per model, runner-ups included), diffs, compare.md and compare.json."""
    seconds = seconds or []
    frame = pd.DataFrame([model_row(m, ctx.constraints) for m in [*models, *seconds]])
    ac, others = models[1], {m.name: m for m in models[2:]}
    diffs = {
        name: paired_bootstrap([r.items for r in ac.results], [r.items for r in m.results], job.compare.bootstrap, job.compare.seed)
        for name, m in others.items()
    }
    write_parquet(frame, out / "compare.parquet")
    first = next(iter(diffs))  # diff.parquet: against the first baseline (Minitron unless compare.methods says otherwise)
    write_parquet(pd.concat([d.assign(method=n) for n, d in diffs.items()], ignore_index=True), out / "diffs.parquet")
    write_parquet(diffs[first], out / "diff.parquet")
    text = markdown(frame, diffs, ctx.constraints, note, job)
    title = " vs ".join(TITLES[m.name] for m in models[1:])
    write_text(f"# {title}: `{ctx.spec.scenario.name}`\n\n" + text, out / "compare.md")
    diff_vs = {}
    for name, d in diffs.items():
        avg = d.set_index("task").loc["average"]
        diff_vs[name] = {"mean": float(avg["diff"]), "low": float(avg["lo"]), "high": float(avg["hi"])}
    baselines: dict[str, Any] = {}
    for name, m in others.items():
        done = json.loads((out / name / f"{name}.json").read_text())
        recorded = {k: done[k] for k in RECORDED if k in done}
        baselines[name] = {"params": m.arch.num_params(), "average": 100 * m.score("average"), **recorded, **_test_means(m)}
    runner_ups = {m.name.split("/")[0]: _runner_up_entry(m) for m in seconds}
    for name, entry in runner_ups.items():
        if name in baselines:
            baselines[name]["runner_up"] = entry
    write_json(
        {
            "scenario": ctx.spec.scenario.name,
            "autocompress": {
                "trial": ctx.row["trial_id"],
                "params": ac.arch.num_params(),
                "average": 100 * ac.score("average"),
                "origin": None if pd.isna(ctx.row.get("origin")) else str(ctx.row.get("origin")),
                "budget": _autocompress_budget(ctx),
                **_test_means(ac),
                **({"runner_up": runner_ups["autocompress"]} if "autocompress" in runner_ups else {}),
            },
            **baselines,
            "methods": list(job.compare.methods or ()),
            "diff": {**diff_vs[first], "vs": first},
            "diff_vs": diff_vs,
            "seeds": list(job.compare.seeds),
            "run": str(ctx.run.path),
            "trial": ctx.row["trial_id"],
            "seconds": timings,
            "measure": note,
            "distill": dataclasses.asdict(job.distill),
            "evaluate": dataclasses.asdict(job.evaluate),
            "probe": _probe_summary(job, out),
        },
        out / "compare.json",
    )
    print(text)
    print("seconds per stage: " + ", ".join(f"{k} {v if isinstance(v, str) else f'{v:.0f}'}" for k, v in timings.items()))
    print(f"\ntable: {out / 'compare.md'} (data: {out / 'compare.parquet'}, {out / 'diff.parquet'})")


def _autocompress_budget(ctx: Context) -> dict[str, Any]:
    """What AutoCompress's pick cost on the selection split: each finished trial's result is scored on all of it once (its
    homogeneous rival too, where the trial's fill or repair moved it); the searches themselves read calibration text."""
    trials = ctx.run.trials
    finished = int((trials["status"] == "ok").sum())
    note = "one per finished trial; not counted: the homogeneous rival's preparation and rivals re-scored after a move"
    return {"trials": len(trials), "selection_evaluations": finished, "selection_sequences": len(ctx.data.select), "note": note}


def _runner_up_entry(m: Model) -> dict[str, Any]:
    """What compare.json keeps of a runner-up: its label, size, benchmark average and test-split scores."""
    return {"label": m.label, "params": m.arch.num_params(), "average": 100 * m.score("average"), "kl_pruned": m.kl, **_test_means(m)}


def _test_means(m: Model) -> dict[str, float]:
    """compare.test_split's scores, means over the distillation seeds (none when it is off)."""
    return {"test_kl": m.test_mean("kl"), "test_perplexity": m.test_mean("perplexity")} if m.test else {}


def _probe_summary(job: CompareJob, out: Path) -> dict[str, Any] | None:
    """compare.probe's settings and every probed candidate of each method (None when the probe was off)."""
    probe = job.compare.probe
    if not probe.on:
        return None
    ac = json.loads((out / "autocompress" / "probe.json").read_text()) if job.compare.trial is None else None
    summary = {**dataclasses.asdict(probe), "autocompress": ac["candidates"] if ac else "compare.trial was given: not probed"}
    from autocompress.baselines.interface import BASELINES

    for name in job.compare.methods or ():
        if name not in BASELINES or not BASELINES[name].probes:
            continue
        if (out / name / "candidates.parquet").exists():  # a table of every scored candidate (Minitron)
            cands = pd.read_parquet(out / name / "candidates.parquet")
            cands = cands[cands["kl_select_probe"].notna()]
            columns = ["params", "kl", "kl_select_probe", "chosen", "architecture"]
            summary[name] = [{**r, "kl_select": r.pop("kl")} for r in cands[columns].to_dict("records")]
        else:  # the pick's own record of its probe (Puzzletron: the MIP's N best choices)
            summary[name] = json.loads((out / name / f"{name}.json").read_text()).get("probe")
    return summary


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
@hydra_task("finished stages are kept in the output folder; rerun the same command to go on from them")
def main(cfg: DictConfig) -> None:
    from autocompress.config.compose import plain

    run_compare(job_from_dict(plain(cfg)), OmegaConf.to_yaml(cfg, resolve=True))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    hydra_entry(main)
