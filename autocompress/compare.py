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
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from autocompress.baselines.comparison import CompareJob, Model, job_from_dict
from autocompress.baselines.context import (
    Context,
    arch_of,
    build_context,
    pick_inputs,
    test_key,
    top_trials,
)
from autocompress.baselines.outputs import write_outputs
from autocompress.baselines.stages import Stages, check_compare_out, open_compare_out
from autocompress.baselines.written import ReportSplit, checkpoints_complete, keep_ranking, rewrite_checkpoints
from autocompress.config.build import overwrite_flag
from autocompress.config.cliargs import hydra_entry
from autocompress.config.cliargs import task as hydra_task
from autocompress.io import log, write_json, write_parquet
from autocompress.quality.tasks import evaluation_paths
from autocompress.results.store import load_run, selection_quality


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

    trials = ctx.run.trials_file

    def writer(trial: str) -> Callable[[Path], object]:
        return lambda folder: export(ExportRequest(trials, folder, trial=trial, overwrite=True))

    rows = _run_probe(job, ctx, {t: writer(t) for t in candidates["trial_id"]}, out.parent / ".probe")
    before = candidates.set_index("trial_id")
    quality = selection_quality(before)
    for r in rows:
        r["kl_select"] = float(before.loc[r["candidate"], quality])
        r["params"] = int(before.loc[r["candidate"], "params"])
    write_json({"chosen": chosen(rows), "candidates": rows, **_probe_inputs(job, ctx)}, out)


def _hash(data: Any) -> str:
    return hashlib.sha1(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:10]


# --------------------------------------------------------------------------- the pipeline


def resolve_run(job: CompareJob, config_yaml: str, stages: dict[str, float | str]) -> Path:
    if job.compare.run:
        return Path(job.compare.run)
    from autocompress.search.tune import preflight, run_sweep

    preflight(job.spec)
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
    """A registered baseline's pick (autocompress.baselines.interface), its checkpoint, its tables and `<name>.json`; with
    compare.runner_up its runner-up's checkpoint and record too, made the same way."""
    from autocompress.baselines.interface import BASELINES

    pick = BASELINES[name].pick(_pick_context(job, ctx, name, out), job.compare.settings_of(name))
    report = ReportSplit(ctx)
    summary = pick.summary()
    shape = pick.description or (
        f"Hidden {pick.arch.hidden_size}, attention per layer (KV heads, '-' = none) `{summary['attention']}`, "
        f"FFN widths {summary['ffn']}; {pick.arch.num_params():,} parameters; selection-split KL {pick.kl_select:.4f}"
    )
    title = f"# {ctx.spec.model.name}, pruned by the {pick.label} baseline for `{ctx.spec.scenario.name}`"
    out.mkdir(parents=True, exist_ok=True)
    card = f"{title}\n\n{shape}; cost model `{ctx.cost_model.id}`."
    summary |= report.scored_and_written(name, pick, out / "pruned", card) | {"card": card}
    for table, frame in pick.tables.items():
        write_parquet(frame, out / f"{table}.parquet")
    if pick.runner_up is not None:  # compare.runner_up
        card = f"# {ctx.spec.model.name}, the {pick.label} baseline's runner-up for `{ctx.spec.scenario.name}`"
        scores = report.scored_and_written(name, pick.runner_up, out / "runner_up" / "pruned", card)
        summary["runner_up"] = pick.runner_up.summary() | scores | {"card": card}
    keep_ranking(pick, out)  # what rewrite_checkpoints slices by
    write_json(summary, out / f"{name}.json")


def test_stage(ctx: Context, path: str | Path | None, out: Path) -> None:
    """Test-split KL to the unpruned model and perplexity of a checkpoint (None: the unpruned model) (compare.test_split)."""
    from autocompress.model.checkpoint import load_checkpoint
    from autocompress.quality.distillation import heldout_scores

    assert ctx.data.test is not None  # loaded by _splits
    student = ctx.model if path is None else load_checkpoint(path, ctx.spec.model).model
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(heldout_scores(student, ctx.model, ctx.data.test), out)


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


def check_measurable(job: CompareJob, ctx: Context) -> None:
    """compare.measure=always: the engine and a device for it are checked before the work, not after hours of it."""
    if job.compare.measure != "always" or ctx.hybrid:
        return
    from autocompress.cluster import init_ray
    from autocompress.cost.engine import check_devices, require_vllm, settings_for

    hw, wl = ctx.spec.scenario.hardware, ctx.spec.scenario.workload
    require_vllm(hw.engine)
    if hw.engine != "vllm-cpu":  # a CPU engine runs on any node; a GPU engine needs a GPU in the cluster
        init_ray(ctx.spec.sweep.ray_address)
        check_devices(settings_for(ctx.spec.profile, hw, [wl], repeats=3, warmup=1))


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
    request = ExportRequest(ctx.run.trials_file, out / "autocompress" / "pruned", trial=row["trial_id"], overwrite=True)
    stages.run(
        "autocompress/pruned", {"trial": row["trial_id"], "architecture": row["architecture"]}, request.out, partial(export, request)
    )
    arch = arch_of(ctx, row["architecture"])
    return Model("autocompress", arch, ctx.cost_model.predict(arch), float(row["kl"]), label=str(row["trial_id"]))


def _baseline_model(job: CompareJob, ctx: Context, out: Path, stages: Stages, name: str) -> Model:
    """A baseline registered in autocompress.baselines.interface, through the same slicing."""
    from autocompress.baselines.interface import BASELINES

    baseline = BASELINES[name]
    settings = job.compare.settings_of(name)
    key = {
        name: dataclasses.asdict(settings) if settings is not None else None,
        **(baseline.key() if baseline.key else {}),
        **pick_inputs(ctx),
    }
    if baseline.probes and job.compare.probe.on:  # without it, keys made before the probe still match
        key["probe"] = _probe_inputs(job, ctx)
    if job.compare.runner_up:
        key["runner_up"] = True
    stage, folder = f"{name}/pruned", out / name
    start = time.time()
    picked = stages.finished(stage, key) and not checkpoints_complete(folder, name)
    if picked and rewrite_checkpoints(ctx, folder, name):  # its checkpoints gone (a carried comparison): not picked again
        log(f"{stage}: picked already; its checkpoints made again from {name}.json in {time.time() - start:.0f}s")
        stages.seconds[stage] = "reused"
    else:
        if picked:  # a checkpoint missing and no ranking kept to slice it again: picked again
            shutil.rmtree(folder / "pruned", ignore_errors=True)
        stages.run(stage, key, folder / "pruned", partial(baseline_stage, job, ctx, name, folder))
    done = json.loads((out / name / f"{name}.json").read_text())
    arch = arch_of(ctx, done["architecture"])
    label = done.get("table_label", done["label"])
    source = _hash(key)  # which pick (settings, ranking): a seed's stages are its, not another pick's of the same shape
    return Model(name, arch, ctx.cost_model.predict(arch), float(done["kl_report"]), label=label, source=source)


def _runner_ups(job: CompareJob, ctx: Context, out: Path, stages: Stages, models: list[Model]) -> list[Model]:
    """compare.runner_up: each method's second by its own selection score, through the same slicing (made with its pick)."""
    from autocompress.checkpoints.pipeline import ExportRequest, export

    found: list[Model] = []
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
            request = ExportRequest(ctx.run.trials_file, out / "autocompress" / "runner_up" / "pruned", trial=trial, overwrite=True)
            key = {"trial": trial, "architecture": row["architecture"]}
            stages.run("autocompress/runner_up/pruned", key, request.out, partial(export, request))
            arch = arch_of(ctx, row["architecture"])
            found.append(Model("autocompress/runner_up", arch, ctx.cost_model.predict(arch), float(row["kl"]), label=str(trial)))
            continue
        done = json.loads((out / m.name / f"{m.name}.json").read_text()).get("runner_up")
        if done is None:
            log(f"compare.runner_up: {m.name} has no second candidate; none distilled")
            continue
        arch = arch_of(ctx, done["architecture"])
        label = done.get("table_label", done["label"])
        found.append(
            Model(f"{m.name}/runner_up", arch, ctx.cost_model.predict(arch), float(done["kl_report"]), label=label, source=m.source)
        )
    return found


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
            evaluated, tested = out / m.name / f"eval-seed{seed}", out / m.name / f"test-seed{seed}.json"
            kept = out / m.name / f"distill-seed{seed}.json"  # distill.json's copy: all the tables read of the distillation
            names = {s: f"{m.name}/{s}-seed{seed}" for s in ("distilled", "eval", "test")}
            keys = {"distilled": {**dkey, **m.student()}, "eval": {**ekey, **dkey, **m.student()}}
            keys["test"] = {**dkey, **m.student(), "test": test_key(ctx)}
            wanted = {"distilled": kept, "eval": evaluated, **({"test": tested} if job.compare.test_split else {})}
            if not target.exists() and all(stages.finished(names[s], keys[s]) and p.exists() for s, p in wanted.items()):
                # scored already and its checkpoint gone (a comparison carried to another machine keeps its small files)
                log(f"{names['distilled']}: scored already ({kept.name}, {evaluated.name}); its checkpoint is not made again")
                stages.seconds[names["distilled"]] = "reused"
            else:
                # the folder is compare's: a stale state from other settings (or a pre-73bc6e8 seed) is redone
                args = (student, target, ctx.model, ctx.tokenizer, spec.data, dspec)
                run = partial(distill, *args, overwrite=True, discard_stale=True, evaluation_dirs=forbid)
                stages.run(names["distilled"], keys["distilled"], target, run)
                made = json.loads((target / "distill.json").read_text())
                if not kept.exists() or json.loads(kept.read_text()) != made:  # a rerun leaves an equal copy as it is
                    write_json(made, kept)
            m.distill.append(json.loads(kept.read_text()))
            stages.run(names["eval"], keys["eval"], evaluated, partial(evaluate_stage, job, ctx, target, evaluated))
            m.results.append(read_result(evaluated))
            if job.compare.test_split:
                stages.run(names["test"], keys["test"], tested, partial(test_stage, ctx, target, tested))
                m.test.append(json.loads(tested.read_text()))
    # the command's results.dir (not the run's: a run made elsewhere, or read-only, is never written into)
    base_eval = Path(job.spec.results_dir).resolve() / "evaluate" / f"base-{spec.model.name}-{_hash(ekey)}"
    stages.run("base/eval", ekey, base_eval, partial(evaluate_stage, job, ctx, ctx.base_path, base_eval), shared=True)
    base_arch = ctx.base_arch
    base = Model("base", base_arch, ctx.cost_model.predict(base_arch), 0.0, label="unpruned", results=[read_result(base_eval)])
    if job.compare.test_split:
        tested = out / "base" / "test.json"
        stages.run(
            "base/test",
            {"teacher": dataclasses.asdict(spec.model), "test": test_key(ctx)},
            tested,
            partial(test_stage, ctx, None, tested),
        )
        base.test.append(json.loads(tested.read_text()))
    return base


def run_compare(job: CompareJob, config_yaml: str = "", overwrite: bool = False) -> Path:
    """The whole comparison; returns the output folder. `overwrite`: a finished comparison in compare.out is replaced."""
    timings: dict[str, float | str] = {}
    run_dir = resolve_run(job, config_yaml, timings).resolve()
    load_run(run_dir)  # a finished sweep run, or one clear error before anything is written (no stray compare/ folder)
    out = Path(job.compare.out or run_dir / "compare").resolve()
    check_compare_out(out, overwrite)
    start = time.time()
    ctx = build_context(job, run_dir)  # refusals (scenario, trial, cost model) come before the output folder exists
    check_measurable(job, ctx)
    stages = open_compare_out(out)  # overwrite=true: unfinished from here on
    probe = job.compare.probe.resolved(ctx.hybrid)  # the default: on for a Llama-family run, off for a hybrid-MoE one
    methods = job.compare.resolved_methods(ctx.hybrid)
    job = dataclasses.replace(job, compare=dataclasses.replace(job.compare, probe=probe, methods=methods))
    timings["prepare"] = time.time() - start
    models = _models(job, ctx, out, stages)
    runner_ups = _runner_ups(job, ctx, out, stages, models) if job.compare.runner_up else []
    base = _distill_and_evaluate(job, ctx, out, stages, [*models, *runner_ups])
    note = measure_costs(job, ctx, [base, *models], out, stages)
    timings |= stages.seconds
    write_outputs(job, ctx, out, [base, *models], note, timings, runner_ups)
    return out


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
@hydra_task("finished stages are kept in the output folder; rerun the same command to go on from them")
def main(cfg: DictConfig) -> None:
    from autocompress.config.compose import plain

    data = plain(cfg)
    run_compare(job_from_dict(data), OmegaConf.to_yaml(cfg, resolve=True), overwrite=overwrite_flag(data))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    hydra_entry(main)
