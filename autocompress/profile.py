"""`python -m autocompress.profile +scenario=NAME`: measure architectures in vLLM, fit and validate the cost model.

Design of experiments over the search space (the base model, the smallest architecture, uniform
shrinks, random heterogeneous ones with no-op layers; a share of the random ones held out), each
measured on the scenario's workload (and `profile.extra_workloads`) in a fresh Ray actor owning
one device. Measurements accumulate in results/cost_models/measurements/<hardware>__<engine>.parquet
(an interrupted run resumes without re-measuring); the fit lands in a versioned JSON file beside it
and is used automatically by later sweeps on that hardware.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import hydra
from omegaconf import DictConfig

from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.build import run_spec_from_dict
from autocompress.config.cliargs import hydra_entry
from autocompress.config.cliargs import task as hydra_task
from autocompress.config.compose import load_workload, plain
from autocompress.config.schema import RunSpec, Workload
from autocompress.cost.design import (
    aic_measurements_path,
    design,
    estimate_design,
    fit_aiconfigurator,
    fit_and_save,
    load_measurements,
    measurements_path,
    run_measurements,
)
from autocompress.cost.engine import require_vllm, settings_for
from autocompress.errors import ConfigError
from autocompress.model.base import load_base_model

# --------------------------------------------------------------------------- entry point


def profiled_workloads(spec: RunSpec) -> list[Workload]:
    """The scenario's workload and `profile.extra_workloads`. The extras share its engine starts, so they take its
    dtype and KV dtype (a command-line workload.kv_dtype=fp8 reaches them too); their files give their shapes."""
    wl = spec.scenario.workload
    extra = [dataclasses.replace(load_workload(n), dtype=wl.dtype, kv_dtype=wl.kv_dtype) for n in spec.profile.extra_workloads]
    return [wl, *extra]


def run_profile(spec: RunSpec) -> Path | None:
    hw = spec.scenario.hardware
    workloads = profiled_workloads(spec)
    settings = settings_for(spec.profile, hw, workloads)
    if spec.profile.source == "aiconfigurator":
        return profile_aiconfigurator(spec, workloads)
    path = measurements_path(spec.results_dir, hw)
    if not spec.profile.measure and load_measurements(path).empty:
        raise ConfigError(
            f"profile.measure=false, but {path} holds no measurements to fit; drop profile.measure=false to measure first "
            f"(or set results.dir to the folder that holds them)"
        )
    base = load_base_model(spec.model).model
    space = SearchSpace.from_base(Architecture.from_llama_config(base.config), spec.search.space)
    plan = design(space, spec.profile.n_random, spec.profile.holdout_share, spec.profile.uniform_fractions, spec.profile.seed)
    table = load_measurements(path)
    if spec.profile.measure:
        require_vllm(hw.engine)
        table = run_measurements(spec, plan, workloads, settings)
    if not spec.profile.fit:
        return None
    return fit_and_save(spec, space, table, workloads, settings)


def profile_aiconfigurator(spec: RunSpec, workloads: list[Workload]) -> Path | None:
    hw = spec.scenario.hardware
    if hw.engine != "vllm" or not hw.aiconfigurator:
        raise ConfigError(
            f"profile.source=aiconfigurator: hardware {hw.name} names no aiconfigurator system (h100_sxm, h200, b200 have their own "
            "tables; rtx5070 and rtx5080 derive from rtx_pro_6000_server); use profile.source=engine"
        )
    base = load_base_model(spec.model).model
    space = SearchSpace.from_base(Architecture.from_llama_config(base.config), spec.search.space)
    plan = design(space, spec.profile.n_random, spec.profile.holdout_share, spec.profile.uniform_fractions, spec.profile.seed)
    path = aic_measurements_path(spec.results_dir, hw)
    if spec.profile.measure:
        table = estimate_design(spec, space, plan, workloads)
    elif path.exists():
        table = load_measurements(path)
    else:
        raise ConfigError(f"profile.measure=false, but {path} does not exist; drop profile.measure=false to estimate first")
    return fit_aiconfigurator(spec, space, table, workloads) if spec.profile.fit else None


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
@hydra_task("the measurements taken so far are kept; rerun the same command to go on without re-measuring them")
def main(cfg: DictConfig) -> None:
    run_profile(run_spec_from_dict(plain(cfg)))


if __name__ == "__main__":
    hydra_entry(main)
