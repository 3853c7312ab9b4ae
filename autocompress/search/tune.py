"""Running a sweep's searches as Ray Tune trials: sweep definitions (conf/sweep/definition/), one trial, recording trials as they finish,
the driver that starts or resumes a run."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autocompress import __version__
from autocompress.cluster import (
    GIB,
    PendingWatch,
    check_ray_address,
    check_storage,
    check_trial_fits,
    start_ray,
)
from autocompress.config.families import family
from autocompress.config.metrics import METRICS, Constraint
from autocompress.config.schema import SETTING_KEYS, LagrangianSettings, RunSpec
from autocompress.cost import CostModel
from autocompress.errors import AutoCompressError, ConfigError
from autocompress.io import RunPaths, log, write_parquet, write_text
from autocompress.model.base import check_model_spec, model_family
from autocompress.results.pareto import COST_DIRECTIONS, QUALITY, pareto_frame
from autocompress.results.runfolder import RunFolder, check_resumable, driver_info, git_sha, new_run_dir, put_back
from autocompress.results.store import architecture_columns, feasibility_columns, trials_frame
from autocompress.search.differentiable import SEARCH_PHASES, SearchInputs, SearchResult
from autocompress.search.prepare import Prepared, PreparedRun
from autocompress.search.tracking import CURVE, check_trackers, last_error, stopper, trackers, watcher


class Interrupted(KeyboardInterrupt):
    """The sweep stopped before every trial was recorded (Ctrl-C, SIGTERM): resume it."""


# --------------------------------------------------------------------------- sweep definitions (conf/sweep/definition/)


def grid_points(grid: dict[str, list[Any]], n: int, base_seed: int) -> list[dict[str, Any]]:
    """The grid's combinations in order, cut to n or cycled with fresh seeds until there are n."""
    keys = sorted(grid)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*(grid[k] for k in keys))]
    points = []
    for i in range(n):
        point = dict(combos[i % len(combos)])
        point.setdefault("seed", base_seed + i // len(combos))
        points.append(point)
    return points


def trial_settings(config: Mapping[str, Any], spec: RunSpec) -> LagrangianSettings:
    """A trial's Lagrangian settings: the spec's defaults with the trial's config over them (grid or Optuna form)."""
    overrides = config.get("settings", config)
    return dataclasses.replace(spec.search.settings, **{k: overrides[k] for k in overrides if k in SETTING_KEYS})


def settings_key(values: Mapping[str, Any]) -> str:
    """Identity of a trial by its settings (a trials.parquet row, or asdict(LagrangianSettings))."""
    return json.dumps({k: float(values[k]) for k in SETTING_KEYS}, sort_keys=True)


def optuna_storage(spec: RunSpec, run: RunPaths) -> tuple[Any, str]:
    """(Optuna storage, study name): a journal file in the run folder, or sweep.optuna_storage."""
    import optuna

    name = f"autocompress-{spec.scenario.name}-{run.path.name}"
    url = spec.sweep.optuna_storage
    if not url:
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(str(run.journal_file))), name
    try:
        return optuna.storages.RDBStorage(url), name
    except Exception as exc:
        raise ConfigError(f"sweep.optuna_storage={url!r} cannot be opened ({exc}); give an Optuna RDB URL or null") from exc


def _close_stale_trials(storage: Any, name: str) -> int:
    """Mark trials a killed driver left RUNNING as failed; the number of trials the study holds."""
    import optuna
    from optuna.trial import TrialState

    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)
    return len(study.trials)


def tune_space(definition: dict[str, Any], spec: RunSpec, run: RunPaths, done: list[dict[str, Any]]) -> tuple[dict[str, Any], Any, int]:
    """(param_space, search_alg, num_samples) for the trials `done` (trials.parquet rows with status ok) lacks."""
    from ray import tune

    if definition["searcher"] == "grid":
        have = {settings_key(r) for r in done}
        points = grid_points(definition["grid"], spec.sweep.num_trials, spec.search.settings.seed)
        todo = [p for p in points if settings_key(dataclasses.asdict(trial_settings(p, spec))) not in have]
        # Longest first (Ray Tune starts them in this order): a trial aiming inside the bounds (margin > 0) also repairs
        # the rival into them (1.2-1.3x a margin-0 trial in the demo); in the grid's own order one starts last and the
        # sweep ends waiting on it alone. The results are the same in any order.
        todo.sort(key=lambda p: -trial_settings(p, spec).margin)
        return {"settings": tune.grid_search(todo)}, None, 1 if todo else 0
    from ray.tune.search.optuna import OptunaSearch

    space: dict[str, Any] = {}
    for key, dist in definition["space"].items():
        low, high = float(dist["low"]), float(dist["high"])
        space[key] = tune.loguniform(low, high) if dist.get("log") else tune.uniform(low, high)
    objective = spec.sweep.objective_cost
    mode = "min" if METRICS[objective] == "max" else "max"
    storage, name = optuna_storage(spec, run)
    prior = _close_stale_trials(storage, name)  # a resumed study goes on; a fresh seed avoids repeating its samples
    searcher = OptunaSearch(
        metric=[QUALITY, objective], mode=["min", mode], seed=spec.search.settings.seed + prior, storage=storage, study_name=name
    )
    return space, searcher, spec.sweep.num_trials - len(done)


# --------------------------------------------------------------------------- one trial (runs in a Ray worker)


def trial_row(
    settings: LagrangianSettings, result: SearchResult, constraints: tuple[Constraint, ...], cost_model: CostModel
) -> dict[str, Any]:
    """One trials.parquet row (see results.TRIAL_SCHEMA)."""
    row: dict[str, Any] = {"status": "ok", "error": ""}
    row.update(dataclasses.asdict(settings))
    row.update(architecture_columns(result.architecture))
    row.update({k: result.costs[k] for k in COST_DIRECTIONS})
    row.update(feasibility_columns(constraints, result.feasible))
    row.update(kl_select=result.kl_select, perplexity_select=result.perplexity_select, kl=result.kl, perplexity=result.perplexity)
    row.update(repair_steps=result.repair_steps, fill_steps=result.fill_steps, origin=result.origin, wall_s=result.wall_s)
    row.update({f"{phase}_s": result.seconds.get(phase, 0.0) for phase in SEARCH_PHASES})
    own = result.searched or result.architecture
    row.update(searched_kl_select=result.searched_kl_select, searched_params=own.num_params())
    row.update(cost_model=cost_model.id, cost_model_extrapolated=cost_model.extrapolates(result.architecture))
    return row


def llama_trainable(spec: RunSpec, prepared: Prepared) -> Any:
    """The family seam's trainable stage: one gradient-search trial of a Llama-family model on Ray Tune."""
    from ray import tune

    return tune.with_parameters(run_trial, spec=spec, inputs=prepared.inputs, cost_model=prepared.cost_model)


def run_trial(config: dict[str, Any], spec: RunSpec, inputs: SearchInputs, cost_model: CostModel) -> None:
    """Ray Tune trainable: one search with this trial's Lagrangian settings (the driver's cost model)."""
    import torch
    from ray import tune

    from autocompress.model.base import load_base_model
    from autocompress.search.differentiable import run_search

    settings = trial_settings(config, spec)
    threads = spec.search.threads or max(1, int(spec.sweep.cpus_per_trial))
    torch.set_num_threads(threads)
    search = dataclasses.replace(spec.search, threads=threads)
    model = load_base_model(spec.model).model
    every = spec.sweep.report_every

    def report_step(record: dict[str, float]) -> None:  # the search's curves: TensorBoard, progress.csv, curves.parquet, trackers
        if int(record["step"]) % every == 0:
            tune.report({f"{CURVE}{k}": v for k, v in record.items()})

    result = run_search(model, inputs, cost_model, search, settings, on_step=report_step if every else None)
    row = trial_row(settings, result, inputs.constraints, cost_model)
    row["trial_id"] = tune.get_context().get_trial_id()
    tune.report(row)


# --------------------------------------------------------------------------- recording trials as they finish


def error_row(trial_id: str, config: Mapping[str, Any], error: str, spec: RunSpec) -> dict[str, Any]:
    settings = dataclasses.asdict(trial_settings(config, spec))
    return {"trial_id": trial_id, "status": "error", "error": error.strip()[-2000:], "feasible": False, **settings}


def _recorder(run: RunFolder, spec: RunSpec, rows: list[dict[str, Any]], total: int) -> Any:
    """A Tune callback that records every finished trial in trials.parquet at once and logs one line for it; its step
    reports go to curves.parquet (one row per trial and step) when it finishes."""
    from ray import tune

    curves: dict[str, list[dict[str, Any]]] = {}

    class TrialRecorder(tune.Callback):
        def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any) -> None:
            if f"{CURVE}step" in result:
                step = {k.removeprefix(CURVE): v for k, v in result.items() if k.startswith(CURVE)}
                curves.setdefault(trial.trial_id, []).append({"trial_id": trial.trial_id, **step})

        def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            if curves.get(trial.trial_id):
                run.add_curves(curves.pop(trial.trial_id))
            r = dict(trial.last_result or {})
            if r.get("status") != "ok":
                self._add(error_row(trial.trial_id, trial.config, "the trial ended without a result", spec))
                return
            costs = " ".join(f"{k}={r.get(k, float('nan')):.4g}" for k in COST_DIRECTIONS)
            state = "feasible" if r.get("feasible") else "INFEASIBLE"
            self._add(r)
            log(
                f"trial {len(rows)}/{total} {trial.trial_id}: {state} kl_select={r.get('kl_select', float('nan')):.4f} "
                f"kl={r.get('kl', float('nan')):.4f} "
                f"ppl={r.get('perplexity', float('nan')):.2f} params={r.get('params', 0) / 1e6:.1f}M {costs} ({r.get('wall_s', 0):.0f}s)"
            )

        def on_trial_recover(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            log(
                f"trial {trial.trial_id} failed (attempt {trial.num_failures} of {spec.sweep.max_failures + 1}): "
                f"{last_error(trial).splitlines()[-1]}; retrying"
            )

        def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            self._add(error_row(trial.trial_id, trial.config, last_error(trial), spec))
            log(f"trial {len(rows)}/{total} {trial.trial_id}: ERROR after {trial.num_failures} attempt(s) (see trials.parquet)")

        def _add(self, row: dict[str, Any]) -> None:
            rows.append(row)
            write_parquet(trials_frame(rows), run.trials_file)
            run.mirror()

    return TrialRecorder()


# --------------------------------------------------------------------------- the driver


def _start(spec: RunSpec, config_yaml: str, prepared: PreparedRun, definition: dict[str, Any], run: RunFolder) -> dict[str, Any]:
    """Fill the claimed run folder: config.yaml, ranking.safetensors, metadata.json (status running)."""
    run.path.mkdir(parents=True, exist_ok=True)
    write_text(config_yaml, run.config_file)
    model_facts = prepared.start(run)  # the family's files (the Llama ranking) and facts
    return {
        "status": "running",
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "autocompress_version": __version__,
        "git_sha": git_sha(),
        "scenario": spec.scenario.name,
        "model": spec.model.name,
        "base_costs": prepared.base_costs,
        "constraints": {c.metric: {"sense": c.sense, "value": c.value} for c in prepared.inputs.constraints},
        **model_facts,
        "base_perplexity": prepared.base_perplexity,
        "base_kl": 0.0,
        "sweep_definition": definition,
        "storage": run.remote,
        "driver": driver_info(),
    }


def _resume(run: RunFolder, prepared: PreparedRun) -> dict[str, Any]:
    """Reopen an interrupted run: its metadata (status running again) and what its trials used (the Llama ranking)."""
    meta = run.metadata()
    check_resumable(run.path, meta)
    prepared.reopen(run)
    return _reopened(meta)


def _reopened(meta: dict[str, Any]) -> dict[str, Any]:
    now = dt.datetime.now().isoformat(timespec="seconds")
    meta.update(status="running", resumed=[*meta.get("resumed", []), now], driver=driver_info())
    meta.pop("error", None)
    return meta


def _fit(
    spec: RunSpec,
    definition: dict[str, Any],
    run: RunFolder,
    prepared: PreparedRun,
    rows: list[dict[str, Any]],
    attempt: int,
) -> None:
    """Run the trials that `rows` lacks on Ray Tune, recording each in trials.parquet as it finishes."""
    from ray import tune

    param_space, searcher, num_samples = tune_space(definition, spec, run, rows)
    if num_samples == 0:
        return
    sw = spec.sweep
    resources = {"cpu": sw.cpus_per_trial, "gpu": sw.gpus_per_trial}
    asked = f"{sw.cpus_per_trial:g} CPUs, {sw.gpus_per_trial:g} GPUs"
    if sw.memory_per_trial_gib:
        resources["memory"] = sw.memory_per_trial_gib * GIB
        asked += f", {sw.memory_per_trial_gib:g} GiB"
    watch = PendingWatch(sw.pending_warn_s, sw.pending_timeout_s, asked + " free for a trial")
    trainable = tune.with_resources(family(model_family(spec.model)).stage("trainable")(spec, prepared), resources)
    if spec.sweep.report_every and searcher is not None:
        # the search's step reports (search_*) carry no final metric; the multi-objective Optuna searcher ignores them
        os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            search_alg=searcher,
            num_samples=num_samples,
            max_concurrent_trials=spec.sweep.max_concurrent_trials or None,
            reuse_actors=True,  # one worker process (imports, base model files) serves many trials
        ),
        run_config=tune.RunConfig(
            name="tune" if attempt == 0 else f"tune-resume-{attempt}",
            storage_path=run.tune_storage,
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=spec.sweep.max_failures),
            callbacks=[_recorder(run, spec, rows, spec.sweep.num_trials), watcher(watch), *trackers(spec, run)],
            stop=stopper(watch),
        ),
    )
    todo = spec.sweep.num_trials - len(rows)
    log(f"running {todo} of {spec.sweep.num_trials} searches on Ray Tune ({definition['searcher']}) -> {run.path}")
    tuner.fit()
    if watch.timed_out:
        raise watch.error(f"resume={run.path}")


def _prepare(spec: RunSpec) -> PreparedRun:
    """The model family's prepare stage with Ray starting beside it; refuses, once Ray is up, trials that no node can run."""
    started: list[Callable[[], None]] = []  # Ray starts once the spec is checked, while the teacher's outputs are computed
    prep = family(model_family(spec.model)).stage("prepare")  # the model family's seam (config/families.py)
    prepared = prep(spec, on_checked=lambda: started.append(start_ray(spec.sweep.ray_address)))
    started[0]()
    check_trial_fits(spec.sweep.cpus_per_trial, spec.sweep.gpus_per_trial, spec.sweep.memory_per_trial_gib)
    return prepared


def preflight(spec: RunSpec) -> None:
    """What a sweep needs from outside, checked before its run folder exists: the base model's folder, the Ray
    cluster's address and the storage URI. Commands call it before run_sweep."""
    check_model_spec(spec.model)  # an empty, foreign or damaged model.path
    if spec.sweep.ray_address:
        check_ray_address(spec.sweep.ray_address)
    if spec.sweep.storage_path:
        check_storage(spec.sweep.storage_path)  # an unreachable URI: refused now, not after 2 minutes of preparation
    check_trackers(spec.sweep.tracking)


def run_sweep(spec: RunSpec, config_yaml: str, resume_dir: Path | None = None, overwrite: bool = False) -> Path:
    """The whole job; returns the run folder. With `resume_dir`, finish that run (its config.yaml must match `spec`);
    `overwrite`: an earlier run of results.run_id is replaced (kept until this one has started). Call preflight(spec) first."""
    run_dir, aside = (resume_dir, None) if resume_dir is not None else new_run_dir(spec, overwrite)
    run = RunFolder.of(spec, run_dir)
    if resume_dir is None:
        try:
            definition = dict(spec.sweep.definition)
            if definition.get("searcher") == "optuna" and spec.sweep.optuna_storage:
                optuna_storage(spec, run)  # a bad URL is refused here, not after the run folder is written
            prepared = _prepare(spec)
            meta, rows = _start(spec, config_yaml, prepared, definition, run), []
        except BaseException:
            if not run.config_file.exists():  # claimed, never started: a corrected rerun may take the id
                shutil.rmtree(run.path, ignore_errors=True)
                if aside is not None:  # overwrite=true: the earlier run comes back
                    put_back(aside, run.path)
                with contextlib.suppress(OSError):  # <results.dir>/<scenario>/ too, when this run was all it held
                    run.path.parent.rmdir()
            raise
        finally:
            if aside is not None and aside.exists():  # the new run has started (or failed once started): the old one goes
                shutil.rmtree(aside, ignore_errors=True)
    else:
        try:
            prepared = _prepare(spec)
        except KeyboardInterrupt as exc:  # the run folder is untouched so far
            raise Interrupted(f"stopped while preparing the resume; {run.path} is unchanged: resume={run.path} again") from exc
        meta, rows = _resume(run, prepared), run.recorded_rows()
        definition = meta["sweep_definition"]  # the grid the run started with, even if conf/sweep/definition/ changed since
        log(f"resuming {run.path}: {len(rows)} of {spec.sweep.num_trials} trials recorded, not run again")
    run.write_metadata(meta)
    start = time.time()
    try:
        _fit(spec, definition, run, prepared, rows, attempt=len(meta.get("resumed", [])))
        if len(rows) < spec.sweep.num_trials:
            raise Interrupted(f"{len(rows)} of {spec.sweep.num_trials} trials recorded in {run.trials_file}")
        trials = trials_frame(rows)
        pareto = pareto_frame(trials)
        write_parquet(trials, run.trials_file)
        write_parquet(pareto, run.pareto_file)
        meta.update(status="complete", finished=dt.datetime.now().isoformat(timespec="seconds"), sweep_wall_s=time.time() - start)
    except KeyboardInterrupt as exc:  # Interrupted (trials missing) is one too
        meta.update(status="interrupted", error=f"{type(exc).__name__}: {exc}", resume=f"resume={run.path}")
        raise Interrupted(f"{len(rows)} of {spec.sweep.num_trials} trials recorded; finish the run with resume={run.path}") from exc
    except BaseException as exc:
        meta.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        run.write_metadata(meta)
    print_summary(trials, pareto, run)
    check_some_trial_finished(trials, run.trials_file)
    return run.path


def check_some_trial_finished(trials: Any, path: Path) -> None:
    """A sweep whose every trial failed is not a success: one line with the most common error (each trial's is in
    trials.parquet at `path`)."""
    failed = trials[trials["status"] != "ok"]
    if len(failed) < len(trials) or trials.empty:
        return
    counts = failed["error"].fillna("").map(lambda e: (e.strip().splitlines() or ["no message"])[-1][:200]).value_counts()
    raise AutoCompressError(
        f"every one of the {len(trials)} trials failed (most often: {counts.index[0]!r}, {int(counts.iloc[0])}x); each trial's "
        f"error is in {path}; check the constraints and settings before rerunning"
    )


def print_summary(trials: Any, pareto: Any, run: RunPaths) -> None:
    ok = int((trials["status"] == "ok").sum())
    feasible = int(trials["feasible"].sum())
    print(f"\n{len(trials)} trials: {ok} finished, {feasible} feasible, {len(pareto)} on a Pareto front")
    if not pareto.empty:
        cols = ["trial_id", "margin", "dual_lr", "params", "kl_select", "kl", "perplexity", *COST_DIRECTIONS]
        table = pareto[cols].copy()
        table["params"] = (table["params"] / 1e6).round(1).astype(str) + "M"
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"\ntrials: {run.trials_file}\npareto: {run.pareto_file}")
