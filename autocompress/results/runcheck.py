"""The one check of a sweep's run folder before a command reads it: each file named with what is wrong with it, in one line.

report, verify, export, compare and `sweep resume=` call `check_run_folder` before they write anything or load a model;
it reads metadata.json, config.yaml and the Parquet tables the command needs, and returns what it read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from autocompress.config.families import LLAMA, family
from autocompress.cost import COST_KEYS
from autocompress.errors import AutoCompressError, ConfigError
from autocompress.io import RUN_PARETO, RUN_TRIALS, RunPaths

if TYPE_CHECKING:
    from autocompress.config.schema import RunSpec

RERUN = "rerun the sweep (copy the whole run folder when moving it)"
NEEDED_COLUMNS = ("trial_id", "status", "architecture", "kl_select", "kl", "params", "feasible")  # what every reader uses
FRONT_COLUMNS = [f"front_{c}" for c in (*COST_KEYS, "all")]


class RunFolderError(AutoCompressError, FileNotFoundError):
    """A folder that is not a sweep run, or a run file that is damaged (also a FileNotFoundError, as `load` always raised)."""


@dataclass(frozen=True)
class CheckedRun(RunPaths):
    """A run folder (its files' paths from RunPaths) and what `check_run_folder` read from it: metadata.json, the RunSpec
    of config.yaml (None where allowed and absent or older), the tables asked for (file name -> DataFrame, as written)."""

    metadata: dict[str, Any]
    spec: RunSpec | None
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)


def check_run_folder(
    run_dir: str | Path,
    *,
    status: str = "complete",
    config: str = "required",
    tables: Iterable[str | Path] = (RUN_TRIALS, RUN_PARETO),
    fronts: bool = True,
) -> CheckedRun:
    """Check a run folder as a command is about to read it; RunFolderError naming the file and the fix otherwise.

    status: "complete" (a finished run), "any" (export and verify also read an interrupted run's trials) or "resumable"
    (resume: not complete, holds the sweep definition; a missing trials.parquet is no trials yet).
    config: "required" (config.yaml must build a RunSpec) or "optional" (missing or from an older AutoCompress: spec None;
    a file that is not YAML is still refused). tables: run-folder file names, or paths of tables beside it; `fronts`: a
    pareto.parquet among them must hold the front_* columns (the report draws them).
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise RunFolderError(f"{run} is not a folder; give a sweep run folder (results/<scenario>/<run_id>)")
    meta = check_metadata(run, status)
    spec = check_config(run, required=config == "required")
    needed = ("trial_id", "status", "architecture") if status == "resumable" else NEEDED_COLUMNS
    read = {}
    for name in tables:
        path = run / Path(name).name  # a table given by its path is one of this folder's (a relative path is not joined twice)
        if status == "resumable" and not path.exists():
            continue
        read[path.name] = check_table(path, front=fronts and path.name == RUN_PARETO, needed=needed)
    return CheckedRun(run, meta, spec, read)


def check_metadata(run: Path, status: str = "complete") -> dict[str, Any]:
    """metadata.json: a JSON object whose status fits `status`, with constraints (metric -> {"value": bound > 0})."""
    path = RunPaths(run).metadata_file
    if not path.exists():
        raise RunFolderError(f"{path} does not exist; give a sweep run folder (results/<scenario>/<run_id>), not its parent")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunFolderError(f"{path} is unreadable ({_first_line(exc)}); {RERUN}") from exc
    if not isinstance(meta, dict):
        raise RunFolderError(f"{path} holds a JSON {type(meta).__name__}, not the object the sweep writes; {RERUN}")
    state = meta.get("status")
    if status == "complete" and state == "running":
        fix = f"wait for the sweep; if it was killed, finish it with resume={run} or rerun it"
        raise RunFolderError(f"{run} is not finished (status running); {fix}")
    if status == "complete" and state != "complete":
        error = meta.get("error", "no error recorded")
        raise RunFolderError(f"{run} did not finish (status {state}: {error}); fix the cause and rerun the sweep")
    if status == "resumable" and not isinstance(meta.get("sweep_definition"), dict):
        raise RunFolderError(f"{path} lacks sweep_definition (the grid the run started with); this run cannot be resumed, start a new one")
    _check_constraints(path, meta)
    return meta


def _check_constraints(path: Path, meta: Mapping[str, Any]) -> None:
    from autocompress.config.metrics import Constraint

    raw = meta.get("constraints")
    if not isinstance(raw, dict):
        what = "lacks constraints" if raw is None else f"holds constraints={raw!r}"
        raise RunFolderError(f"{path} {what}, not a mapping metric -> {{sense, value}} as the sweep writes; {RERUN}")
    for metric, bound in raw.items():
        value = bound.get("value") if isinstance(bound, dict) else None
        try:
            Constraint(str(metric), float(value))  # type: ignore[arg-type]
        except (TypeError, ValueError, ConfigError) as exc:
            raise RunFolderError(f"{path}: constraints.{metric}={bound!r} is not a known metric with a value > 0; {RERUN}") from exc
    costs = meta.get("base_costs", {})
    if not isinstance(costs, dict) or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in costs.values()):
        raise RunFolderError(f"{path}: base_costs={costs!r} is not a mapping metric -> number; {RERUN}")


def check_config(run: Path, required: bool = True) -> RunSpec | None:
    """config.yaml as a RunSpec; None if it is not `required` and missing or no longer builds one (an older run)."""
    from omegaconf import DictConfig, OmegaConf

    from autocompress.config.build import run_spec_from_dict
    from autocompress.config.compose import plain

    path = RunPaths(run).config_file
    if not path.exists():
        if not required:
            return None
        raise RunFolderError(f"{path} does not exist; give a sweep run folder (results/<scenario>/<run_id>)")
    try:
        loaded = OmegaConf.load(path)
    except Exception as exc:  # yaml's ScannerError / ParserError, an unreadable file
        raise RunFolderError(f"{path} is not valid YAML ({_first_line(exc)}); {RERUN}") from exc
    if not isinstance(loaded, DictConfig):
        raise RunFolderError(f"{path} holds a YAML list, not the config mapping the sweep writes; {RERUN}")
    try:
        return run_spec_from_dict(plain(loaded))
    except ConfigError as exc:
        if not required:
            return None
        raise RunFolderError(f"{path}: {exc} (a run from another AutoCompress version? {RERUN})") from exc
    except Exception as exc:  # an interpolation or a value of the wrong type in a hand-edited file
        raise RunFolderError(f"{path} does not describe a sweep ({type(exc).__name__}: {_first_line(exc)}); {RERUN}") from exc


def read_table(path: Path) -> pd.DataFrame:
    """A run's Parquet file; RunFolderError (one line: the file, the cause, the fix) if it cannot be read."""
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow's ArrowInvalid, OSError: a truncated, partly copied or foreign file
        raise RunFolderError(
            f"{path} cannot be read ({type(exc).__name__}: {_first_line(exc)}); if its sweep was cut off, finish it with "
            f"resume={path.parent}, else {RERUN}"
        ) from exc


def check_table(path: Path, front: bool = False, needed: Iterable[str] = NEEDED_COLUMNS) -> pd.DataFrame:
    """A trials or pareto table: readable, with the columns readers use (and the front_* ones where `front`), and an
    architecture every finished trial's can be rebuilt from."""
    if not path.exists():
        raise RunFolderError(f"{path} does not exist; is {path.parent} a finished sweep run? Rerun the sweep")
    df = read_table(path)
    missing = [c for c in needed if c not in df.columns]
    if missing:
        what = "a run from an older AutoCompress, or not a sweep's table"
        raise RunFolderError(f"{path} lacks the column(s) {', '.join(missing)}: {what}; {RERUN}")
    lost = [c for c in FRONT_COLUMNS if c not in df.columns] if front else []
    if lost:
        raise RunFolderError(f"{path} lacks the front column(s) {', '.join(lost)}: not a pareto.parquet the sweep wrote; {RERUN}")
    check_architectures(path, df)
    return df


def check_architectures(path: Path, df: pd.DataFrame) -> None:
    """Every non-empty `architecture` cell parses as its family's JSON (a failed trial may have none)."""
    families = df["family"] if "family" in df.columns else pd.Series([LLAMA] * len(df), index=df.index)
    for trial, text, name in zip(df["trial_id"], df["architecture"], families, strict=True):
        if text is None or (isinstance(text, float) and math.isnan(text)) or text is pd.NA or text == "":
            continue
        try:
            _architecture(str(text), str(name))
        except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
            shown = str(text)[:60] + ("..." if len(str(text)) > 60 else "")
            raise RunFolderError(
                f"{path}: trial {trial}'s architecture {shown!r} is not an architecture ({type(exc).__name__}: {_first_line(exc)}); {RERUN}"
            ) from exc


def _architecture(text: str, name: str) -> None:
    family(name).stage("shape")(text)  # the family's own parser (config/families.py)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
