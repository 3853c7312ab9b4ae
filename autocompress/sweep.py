"""`python -m autocompress.sweep +scenario=NAME`: many Lagrangian searches on Ray Tune, Pareto fronts to Parquet.

A run is resumable: trials.parquet is rewritten (atomically) after every finished trial, and
`resume=true` (or `resume=RUN_FOLDER`) runs only the trials it does not hold yet.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from autocompress.cluster import (
    fetch_dir,
    storage_join,
)
from autocompress.config.build import overwrite_flag, run_spec_from_dict
from autocompress.config.cliargs import hydra_entry
from autocompress.config.cliargs import task as hydra_task
from autocompress.config.compose import plain
from autocompress.errors import ConfigError
from autocompress.io import log
from autocompress.results.runfolder import RunFolder, resume_target
from autocompress.search.tune import preflight, run_sweep


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("SIGTERM")  # `ray job stop`, a pod eviction: record the run as interrupted


def resume_mode(data: dict[str, Any], resume: Any) -> str:
    """new, resume or complete: what `resume` (false, true, auto, a folder or URI) asks of this run."""
    mode = str(resume).lower()
    if mode in ("false", "none"):
        return "new"
    if mode != "auto":
        return "resume"
    run_id, scenario = (data.get("results") or {}).get("run_id"), (data.get("scenario") or {}).get("name")
    if not run_id or not scenario:
        raise ConfigError("resume=auto needs +scenario=NAME and results.run_id=ID (start that run, or resume it if it exists)")
    run_dir = Path((data.get("results") or {}).get("dir") or "results").resolve() / str(scenario) / str(run_id)
    storage = (data.get("sweep") or {}).get("storage_path")
    run = RunFolder(run_dir)
    if not run.config_file.exists() and not (storage and fetch_dir(storage_join(storage, str(scenario), str(run_id)), run_dir)):
        return "new"
    meta = run.metadata() if run.metadata_file.exists() else {}
    return "complete" if meta.get("status") == "complete" else "resume"


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
@hydra_task("stopped before the run folder was written; nothing to resume, rerun the command")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    signal.signal(signal.SIGTERM, _sigterm)
    data = plain(cfg)
    mode = resume_mode(data, cfg.get("resume", False))
    overwrite = overwrite_flag(data)
    if overwrite and mode != "new":
        raise ConfigError("overwrite=true starts results.run_id afresh and resume= finishes it: give one of them")
    if mode == "new":
        spec = run_spec_from_dict(data)
        preflight(spec)  # model folder, Ray address, storage URI: before the run folder exists
        run_sweep(spec, OmegaConf.to_yaml(cfg, resolve=True), overwrite=overwrite)
    elif mode == "complete":
        log("resume=auto: the run is already complete; nothing to do")
    else:
        resume = True if str(cfg.get("resume")).lower() == "auto" else cfg.get("resume")
        data, run_dir = resume_target(data, resume, list(HydraConfig.get().overrides.task))
        spec = run_spec_from_dict(data)
        preflight(spec)
        run_sweep(spec, "", resume_dir=run_dir)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    hydra_entry(main)
