"""A sweep's run folder: its files, metadata, mirroring to remote storage, and which run a resume continues with which settings."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from autocompress.cluster import (
    fetch_dir,
    is_uri,
    mirror_files,
    storage_join,
)
from autocompress.config.compose import plain
from autocompress.config.schema import RunSpec
from autocompress.errors import ConfigError
from autocompress.io import RUN_FILES, RUN_TRIALS, RunPaths, log, write_json
from autocompress.results.runcheck import check_run_folder

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# how a run executes, not what it computes: a resume may change these
EXECUTION_KEYS = (
    "ray_address",
    "cpus_per_trial",
    "gpus_per_trial",
    "memory_per_trial_gib",
    "pending_warn_s",
    "pending_timeout_s",
    "max_concurrent_trials",
    "max_failures",
    "report_every",  # what the run shows, not what it computes: a resume may change it too
    "tracking",
    "tracking_uri",
)


# --------------------------------------------------------------------------- the run folder


@dataclasses.dataclass(frozen=True)
class RunFolder(RunPaths):
    """results/<scenario>/<run_id>/ (its files' paths from RunPaths), and its copy under sweep.storage_path when that is set."""

    remote: str | None = None  # <storage_path>/<scenario>/<run_id>

    @staticmethod
    def of(spec: RunSpec, path: Path) -> RunFolder:
        storage = spec.sweep.storage_path
        remote = storage_join(storage, spec.scenario.name, path.name) if storage else None
        if remote and not is_uri(remote) and Path(remote).resolve() == path.resolve():
            remote = None
        return RunFolder(path, remote)

    @property
    def tune_storage(self) -> str:
        """Ray Tune's storage_path (absolute, or a URI): the experiments live under it."""
        return self.remote or str(self.path)

    def mirror(self) -> None:
        if self.remote:
            mirror_files(self.path, RUN_FILES, self.remote)

    def metadata(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.metadata_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.metadata_file} is unreadable ({exc}); this run cannot be resumed, start a new one") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{self.path}/metadata.json holds a JSON {type(data).__name__}, not an object; this run cannot be resumed")
        return data

    def write_metadata(self, meta: dict[str, Any]) -> None:
        write_json(meta, self.metadata_file)
        self.mirror()

    def add_curves(self, steps: list[dict[str, Any]]) -> None:
        """A finished trial's search curves (one row per reported step) appended to curves.parquet (rows of a trial that
        ran again, after a lost node or a resume, replace its earlier ones)."""
        import pandas as pd

        from autocompress.io import write_parquet

        path, new = self.curves_file, pd.DataFrame(steps)
        if path.exists():
            old = pd.read_parquet(path)
            new = pd.concat([old[~old["trial_id"].isin(set(new["trial_id"]))], new], ignore_index=True)
        write_parquet(new, path)
        self.mirror()

    def recorded_rows(self) -> list[dict[str, Any]]:
        """Rows of trials.parquet that finished (status ok): the trials a resume keeps."""
        from autocompress.results.runcheck import read_table

        path = self.trials_file
        if not path.exists():
            return []
        df = read_table(path)
        return [{k: (None if _missing(v) else v) for k, v in r.items()} for r in df[df["status"] == "ok"].to_dict("records")]


def _missing(value: Any) -> bool:
    import pandas as pd

    return not isinstance(value, (list, dict, str)) and bool(pd.isna(value))


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=5)
    except OSError:
        return None
    return out.stdout.strip() or None


def new_run_dir(spec: RunSpec, overwrite: bool = False) -> tuple[Path, Path | None]:
    """(the new run's folder, claimed; the earlier run of that id set aside by overwrite=true, or None). The caller
    deletes the set-aside folder once the new run has started, and puts it back (put_back) if it does not."""
    run_id = spec.run_id or dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(spec.results_dir).resolve() / spec.scenario.name / run_id
    aside = None
    if RunPaths(run_dir).config_file.exists():
        if not overwrite:
            raise ConfigError(
                f"{run_dir} already exists; choose another results.run_id, finish that run with resume=true, "
                "or add overwrite=true to replace it"
            )
        aside = set_aside(run_dir, spec)
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir()  # the claim: of two sweeps given one id, exactly one gets here
    except FileExistsError:
        raise ConfigError(
            f"{run_dir} already exists (another sweep is starting it, or one died before writing config.yaml: then "
            "remove the folder); choose another results.run_id"
        ) from None
    except OSError as exc:
        if aside is not None:
            put_back(aside, run_dir)
        raise ConfigError(
            f"results.dir={spec.results_dir}: cannot create {run_dir} ({exc.strerror or exc}); choose a folder you can write"
        ) from exc
    return run_dir, aside


def set_aside(run_dir: Path, spec: RunSpec) -> Path:
    """overwrite=true: the earlier run folder renamed beside it (hidden), after the checks that it may be replaced."""
    if spec.sweep.storage_path:
        raise ConfigError(
            f"overwrite=true replaces the local run folder only, and sweep.storage_path={spec.sweep.storage_path} holds a copy "
            "of it too: choose another results.run_id"
        )
    meta = _metadata(run_dir)
    pid = running_pid(meta)
    if pid is not None:
        raise ConfigError(f"{run_dir} is still being run by process {pid} on this host; stop it before replacing it")
    aside = run_dir.with_name(f".{run_dir.name}.old{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(run_dir, aside)
    log(f"overwrite=true: replacing {run_dir} (deleted once the new run has started)")
    return aside


def put_back(aside: Path, run_dir: Path) -> None:
    """The earlier run that set_aside moved, back in its place: the new run never started."""
    os.replace(aside, run_dir)


def _metadata(run_dir: Path) -> dict[str, Any]:
    try:
        meta = json.loads(RunPaths(run_dir).metadata_file.read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def running_pid(meta: Mapping[str, Any]) -> int | None:
    """The process id of a live sweep on this host that runs the run of `meta`, or None."""
    driver = meta.get("driver") or {}
    if meta.get("status") != "running" or driver.get("host") != socket.gethostname() or driver.get("pid") == os.getpid():
        return None
    import psutil

    try:
        alive = "autocompress.sweep" in " ".join(psutil.Process(int(driver["pid"])).cmdline())
    except (psutil.Error, KeyError, ValueError, TypeError):
        alive = False
    return int(driver["pid"]) if alive else None


def driver_info() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def check_resumable(run_dir: Path, meta: Mapping[str, Any]) -> None:
    if meta.get("status") == "complete":
        raise ConfigError(f"{run_dir} is already complete; nothing to resume (drop resume to start a new run)")
    pid = running_pid(meta)
    if pid is not None:
        raise ConfigError(f"{run_dir} is still being run by process {pid} on this host; stop it before resuming")


# --------------------------------------------------------------------------- resume: which run, with which settings


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, Mapping):
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _override_conflicts(current: dict[str, Any], stored: dict[str, Any], overrides: list[str]) -> list[str]:
    """Command-line overrides whose value differs from the run's config.yaml (execution keys excepted)."""
    now, run = _flat(current), _flat(stored)
    free = {"resume", "overwrite", "results.run_id", "results.dir", "ray.address", *(f"sweep.{k}" for k in EXECUTION_KEYS)}
    conflicts = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in free or key.startswith("hydra"):
            continue
        if key == "scenario":
            key = "scenario.name"
        keys = sorted(k for k in set(now) | set(run) if k == key or k.startswith(key + "."))
        keys = [k for k in keys if k.rsplit(".", 1)[-1] not in EXECUTION_KEYS]
        conflicts += [f"{k} (run: {run.get(k)!r}, now: {now.get(k)!r})" for k in keys if now.get(k) != run.get(k)]
    return conflicts


def resume_target(current: dict[str, Any], resume: Any, overrides: list[str]) -> tuple[dict[str, Any], Path]:
    """(the run's config.yaml as plain data, the run folder) for resume=true or resume=PATH/URI.

    Execution keys (ray.address, sweep.cpus_per_trial, ...) given on this command line replace the
    run's; any other override must agree with the run's config.yaml.
    """
    results_dir = Path((current.get("results") or {}).get("dir") or "results").resolve()
    storage = (current.get("sweep") or {}).get("storage_path")
    remote: str | None = None
    if resume is True or str(resume).lower() == "true":
        run_id = (current.get("results") or {}).get("run_id")
        scenario = (current.get("scenario") or {}).get("name")
        if not run_id or not scenario:
            raise ConfigError("resume=true needs the run's +scenario=NAME and results.run_id=ID; or give its folder: resume=PATH")
        run_dir = results_dir / str(scenario) / str(run_id)
        remote = storage_join(storage, str(scenario), str(run_id)) if storage else None
    elif is_uri(str(resume)):
        remote = str(resume).rstrip("/")
        run_dir = results_dir.joinpath(*remote.split("/")[-2:])
    else:
        run_dir = Path(str(resume)).expanduser().resolve()
    config_file = RunPaths(run_dir).config_file
    if not config_file.exists() and not (remote and fetch_dir(remote, run_dir)):
        where = f"{run_dir} (nor {remote})" if remote else str(run_dir)
        raise ConfigError(f"resume={resume}: {where} holds no config.yaml; give the folder of a sweep run (results/<scenario>/<run_id>)")
    checked = check_run_folder(run_dir, status="resumable", tables=(RUN_TRIALS,))  # before the model is loaded, nothing written
    check_resumable(run_dir, checked.metadata)  # a finished run, or one another process runs: refused now, not after preparing
    loaded = OmegaConf.load(config_file)
    assert isinstance(loaded, DictConfig)
    stored = plain(loaded)
    conflicts = _override_conflicts(current, stored, overrides)
    if conflicts:
        raise ConfigError(
            f"resume: a resumed run keeps the settings in {config_file}, and these overrides differ: "
            f"{'; '.join(conflicts[:6])}. Drop them (only ray.address and sweep.{{{','.join(EXECUTION_KEYS[1:])}}} may change)"
        )
    given = {o.split("=", 1)[0].lstrip("+~").replace("ray.address", "sweep.ray_address") for o in overrides}
    stored["sweep"].update({k: current["sweep"][k] for k in EXECUTION_KEYS if f"sweep.{k}" in given})
    return stored, run_dir
