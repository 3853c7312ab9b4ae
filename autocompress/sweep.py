"""`python -m autocompress.sweep +scenario=NAME`: many Lagrangian searches on Ray Tune, Pareto fronts to Parquet."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf

from autocompress import __version__
from autocompress.compose import plain
from autocompress.config import METRICS, Constraint, LagrangianSettings, RunSpec, run_spec_from_dict
from autocompress.cost import CostModel
from autocompress.errors import AutoCompressError, ConfigError
from autocompress.pareto import COST_DIRECTIONS, pareto_frame
from autocompress.prepare import Prepared, log, prepare
from autocompress.raycluster import check_ray_address, init_ray
from autocompress.results import architecture_columns, feasibility_columns, trials_frame, write_json, write_parquet, write_text
from autocompress.search import SearchInputs, SearchResult

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SETTING_KEYS = [f.name for f in dataclasses.fields(LagrangianSettings)]


# --------------------------------------------------------------------------- sweep definitions (sweeps/)


def load_definition(name: str) -> dict[str, Any]:
    """A sweep definition: sweeps/<name>.yaml, or a path to a YAML file."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else PROJECT_ROOT / "sweeps" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (PROJECT_ROOT / "sweeps").glob("*.yaml"))
        raise ConfigError(f"sweep.definition={name!r}: {path} does not exist; known definitions: {known}")
    definition = yaml.safe_load(path.read_text()) or {}
    searcher = definition.get("searcher")
    if searcher not in ("grid", "optuna"):
        raise ConfigError(f"{path}: searcher must be grid or optuna, got {searcher!r}")
    params = definition.get("grid" if searcher == "grid" else "space") or {}
    unknown = sorted(set(params) - set(SETTING_KEYS))
    if unknown or not params:
        raise ConfigError(f"{path}: vary at least one Lagrangian setting; unknown: {unknown}; known: {SETTING_KEYS}")
    return definition


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


def tune_space(definition: dict[str, Any], spec: RunSpec) -> tuple[dict[str, Any], Any, int]:
    """(param_space, search_alg, num_samples) for Ray Tune."""
    from ray import tune

    if definition["searcher"] == "grid":
        points = grid_points(definition["grid"], spec.sweep.num_trials, spec.search.settings.seed)
        return {"settings": tune.grid_search(points)}, None, 1
    from ray.tune.search.optuna import OptunaSearch

    space: dict[str, Any] = {}
    for key, dist in definition["space"].items():
        low, high = float(dist["low"]), float(dist["high"])
        space[key] = tune.loguniform(low, high) if dist.get("log") else tune.uniform(low, high)
    objective = spec.sweep.objective_cost
    mode = "min" if METRICS[objective] == "max" else "max"
    searcher = OptunaSearch(metric=["kl", objective], mode=["min", mode], seed=spec.search.settings.seed)
    return space, searcher, spec.sweep.num_trials


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
    row.update(kl=result.kl, perplexity=result.perplexity, repair_steps=result.repair_steps, wall_s=result.wall_s)
    row.update(cost_model=cost_model.id, cost_model_extrapolated=cost_model.extrapolates(result.architecture))
    return row


def run_trial(config: dict[str, Any], spec: RunSpec, inputs: SearchInputs, cost_model: CostModel) -> None:
    """Ray Tune trainable: one search with this trial's Lagrangian settings (the driver's cost model)."""
    import torch
    from ray import tune

    from autocompress.models import load_base_model
    from autocompress.search import run_search

    overrides = config.get("settings", config)
    settings = dataclasses.replace(spec.search.settings, **{k: overrides[k] for k in overrides if k in SETTING_KEYS})
    threads = spec.search.threads or max(1, int(spec.sweep.cpus_per_trial))
    torch.set_num_threads(threads)
    search = dataclasses.replace(spec.search, threads=threads)
    model = load_base_model(spec.model).model
    result = run_search(model, inputs, cost_model, search, settings)
    row = trial_row(settings, result, inputs.constraints, cost_model)
    row["trial_id"] = tune.get_context().get_trial_id()
    tune.report(row)


# --------------------------------------------------------------------------- the driver


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=5)
    except OSError:
        return None
    return out.stdout.strip() or None


def _run_dir(spec: RunSpec) -> Path:
    run_id = spec.run_id or dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(spec.results_dir).resolve() / spec.scenario.name / run_id
    if run_dir.exists():
        raise ConfigError(f"{run_dir} already exists; choose another results.run_id")
    return run_dir


def _collect(result_grid: Any, spec: RunSpec) -> list[dict[str, Any]]:
    rows = []
    for res in result_grid:
        if res.error is None and res.metrics and res.metrics.get("status") == "ok":
            rows.append(dict(res.metrics))
            continue
        cfg = res.config or {}
        settings = dataclasses.asdict(
            dataclasses.replace(spec.search.settings, **{k: v for k, v in cfg.get("settings", cfg).items() if k in SETTING_KEYS})
        )
        rows.append(
            {
                "trial_id": Path(str(res.path)).name,
                "status": "error",
                "error": str(res.error).strip()[-2000:],
                "feasible": False,
                **settings,
            }
        )
    return rows


def _progress_callback(total: int) -> Any:
    from ray import tune

    class TrialLine(tune.Callback):
        """One line per finished trial instead of Tune's tables."""

        done = 0

        def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            TrialLine.done += 1
            r = trial.last_result or {}
            costs = " ".join(f"{k}={r.get(k, float('nan')):.4g}" for k in COST_DIRECTIONS)
            state = "feasible" if r.get("feasible") else "INFEASIBLE"
            log(
                f"trial {TrialLine.done}/{total} {trial.trial_id}: {state} kl={r.get('kl', float('nan')):.4f} "
                f"ppl={r.get('perplexity', float('nan')):.2f} params={r.get('params', 0) / 1e6:.1f}M {costs} ({r.get('wall_s', 0):.0f}s)"
            )

        def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            TrialLine.done += 1
            log(f"trial {TrialLine.done}/{total} {trial.trial_id}: ERROR (see trials.parquet)")

    return TrialLine()


def run_sweep(spec: RunSpec, config_yaml: str) -> Path:
    """The whole job; returns the run folder."""
    from ray import tune

    definition = load_definition(spec.sweep.definition)
    if spec.sweep.ray_address:
        check_ray_address(spec.sweep.ray_address)
    run_dir = _run_dir(spec)
    prepared: Prepared = prepare(spec)
    run_dir.mkdir(parents=True)
    write_text(config_yaml, run_dir / "config.yaml")
    prepared.inputs.ranking.save(run_dir / "ranking.safetensors")  # export slices weights in this order
    meta: dict[str, Any] = {
        "status": "running",
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "autocompress_version": __version__,
        "git_sha": _git_sha(),
        "scenario": spec.scenario.name,
        "model": spec.model.name,
        "cost_model": prepared.cost_model.describe(),
        "base_costs": prepared.base_costs,
        "constraints": {c.metric: {"sense": c.sense, "value": c.value} for c in prepared.inputs.constraints},
        "base_params": prepared.space.base.num_params(),
        "base_architecture": prepared.space.base.to_json(),
        "base_perplexity": prepared.base_perplexity,
        "base_kl": 0.0,
        "sweep_definition": definition,
    }
    write_json(meta, run_dir / "metadata.json")
    try:
        init_ray(spec.sweep.ray_address)
        param_space, searcher, num_samples = tune_space(definition, spec)
        trainable = tune.with_resources(
            tune.with_parameters(run_trial, spec=spec, inputs=prepared.inputs, cost_model=prepared.cost_model),
            {"cpu": spec.sweep.cpus_per_trial},
        )
        tuner = tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=tune.TuneConfig(
                search_alg=searcher, num_samples=num_samples, max_concurrent_trials=spec.sweep.max_concurrent_trials or None
            ),
            run_config=tune.RunConfig(
                name="tune",
                storage_path=str(run_dir),
                verbose=0,
                failure_config=tune.FailureConfig(max_failures=spec.sweep.max_failures),
                callbacks=[_progress_callback(spec.sweep.num_trials)],
            ),
        )
        log(f"running {spec.sweep.num_trials} searches on Ray Tune ({definition['searcher']}) -> {run_dir}")
        start = time.time()
        grid = tuner.fit()
        trials = trials_frame(_collect(grid, spec))
        pareto = pareto_frame(trials)
        write_parquet(trials, run_dir / "trials.parquet")
        write_parquet(pareto, run_dir / "pareto.parquet")
        meta.update(status="complete", finished=dt.datetime.now().isoformat(timespec="seconds"), sweep_wall_s=time.time() - start)
    except BaseException as exc:
        meta.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        write_json(meta, run_dir / "metadata.json")
    print_summary(trials, pareto, run_dir)
    return run_dir


def print_summary(trials: Any, pareto: Any, run_dir: Path) -> None:
    ok = int((trials["status"] == "ok").sum())
    feasible = int(trials["feasible"].sum())
    print(f"\n{len(trials)} trials: {ok} finished, {feasible} feasible, {len(pareto)} on a Pareto front")
    if not pareto.empty:
        cols = ["trial_id", "margin", "dual_lr", "params", "kl", "perplexity", *COST_DIRECTIONS]
        table = pareto[cols].copy()
        table["params"] = (table["params"] / 1e6).round(1).astype(str) + "M"
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"\ntrials: {run_dir / 'trials.parquet'}\npareto: {run_dir / 'pareto.parquet'}")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        spec = run_spec_from_dict(plain(cfg))
        run_sweep(spec, OmegaConf.to_yaml(cfg, resolve=True))
    except AutoCompressError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    main()
