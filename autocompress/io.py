"""Writing outputs so that nothing is half-written: atomic text / JSON / Parquet files, staged output folders, the log line,
and the names of a run folder's files."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from autocompress.errors import ConfigError

if TYPE_CHECKING:
    import pandas as pd

T = TypeVar("T")

# A sweep's run folder, results/<scenario>/<run_id>/: every module names its files through these.
RUN_CONFIG = "config.yaml"  # the composed config the sweep ran with
RUN_METADATA = "metadata.json"  # status, constraints, cost model, code version
RUN_RANKING = "ranking.safetensors"  # the importance order that export slices weights in
RUN_TRIALS = "trials.parquet"
RUN_PARETO = "pareto.parquet"
RUN_CURVES = "curves.parquet"  # every trial's search curves: loss, KL, multipliers, expected costs per reported step
RUN_VERIFY = "verify"  # verify's own folder: measured.parquet / estimated.parquet; the sweep's tables stay as written
RUN_JOURNAL = "optuna.journal"  # Optuna's study, when the sweep's searcher is Optuna (a resume continues it)
RUN_FILES = (RUN_CONFIG, RUN_METADATA, RUN_RANKING, RUN_TRIALS, RUN_PARETO, RUN_CURVES, RUN_JOURNAL)  # what a mirror copies


class _RunFile:
    """One file of a run folder as an attribute of RunPaths: its name joined to the folder."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, run: Any, owner: Any = None) -> Path:
        return Path(run.path) / self.name


@dataclass(frozen=True)
class RunPaths:
    """A run folder and where each of its files lives: the one place a run file's name is joined to its folder
    (results.runfolder.RunFolder adds the remote copy and what reads and writes them)."""

    path: Path

    config_file = _RunFile(RUN_CONFIG)
    metadata_file = _RunFile(RUN_METADATA)
    ranking_file = _RunFile(RUN_RANKING)
    trials_file = _RunFile(RUN_TRIALS)
    pareto_file = _RunFile(RUN_PARETO)
    curves_file = _RunFile(RUN_CURVES)
    verify_dir = _RunFile(RUN_VERIFY)
    journal_file = _RunFile(RUN_JOURNAL)


def log(msg: str) -> None:
    print(f"[autocompress] {msg}", file=sys.stderr, flush=True)


def check_writable(out: Path, key: str) -> None:
    """ConfigError (naming `key`) unless folder `out` exists as a folder or can be created and written, checked before any work.

    Creates nothing: the nearest existing ancestor must be a writable folder (a probe file is made and removed there).
    """
    import tempfile

    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}={out} is a file; give a folder")
    anchor = next(p for p in (out, *out.parents) if p.exists())
    if not anchor.is_dir():
        raise ConfigError(f"{key}={out}: {anchor} is a file, not a folder; choose another {key}")
    try:
        with tempfile.TemporaryFile(dir=anchor):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}={out}: {anchor} cannot be written ({exc.strerror or exc}); choose a folder you can write") from exc


def atomic_write(path: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` into a temporary file beside `path`, then one rename: a reader sees the old file or the whole new one,
    never half of it (the one home of the project's atomic file writes)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_dir(out: Path, fill: Callable[[Path], T], first_wins: bool = False) -> T:
    """`fill(tmp)` into a temporary folder beside `out`, then one rename: `out` appears whole or not at all (the folder
    counterpart of atomic_write). `first_wins`: `out` is a cache another process may build at the same time; if it got
    there first, its folder is kept and this one dropped. Otherwise `out` must be absent or an empty folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        result = fill(tmp)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (first_wins and out.is_dir()):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def write_parquet(df: pd.DataFrame, path: Path) -> Path:
    """Write `df` to `path` atomically (temp file in the same folder, then rename)."""
    return atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def markdown(table: pd.DataFrame) -> str:
    """A DataFrame as a Markdown table, values as str() gives them."""
    lines = ["| " + " | ".join(map(str, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def write_text(text: str, path: Path) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(data: Mapping[str, Any], path: Path) -> Path:
    return write_text(json.dumps(data, indent=2, default=str) + "\n", path)


def check_output(
    out: Path,
    overwrite: bool,
    key: str = "out=DIR",
    marker: str = "config.json",
    what: str = "an exported checkpoint",
    flag: str = "overwrite=true",
) -> None:
    """The one rule for every command's output folder: an unwritable `out` is refused, an existing one too unless
    `overwrite`, and even then anything but `what` (a folder holding `marker`) or an empty folder: `flag` never
    replaces a folder the command did not write. `key` names the setting that chose `out`."""

    if not out.exists():
        check_writable(out, key.split("=")[0])
        return
    ours = out.is_dir() and ((out / marker).exists() or not any(out.iterdir()))
    if not overwrite:
        fix = f"choose another {key}, or add {flag} to replace it" if ours else f"it is not {what} (no {marker}): choose another {key}"
        raise ConfigError(f"{out} already exists; {fix}")
    if not ours:
        raise ConfigError(f"{out} is not {what} (no {marker}); {flag} replaces only those: choose another {key}")
    check_writable(out.parent, key.split("=")[0])  # the new output is staged beside it, then renamed


def normal_modes(root: Path) -> None:
    """The modes a user's own files get (umask applied): temporary-file writers leave 0600, which a shared or published
    checkpoint should not have."""
    mask = os.umask(0)
    os.umask(mask)
    if not root.exists():
        return
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


@contextmanager
def staged(out: Path, overwrite: bool, **output: str) -> Iterator[Path]:
    """A temporary folder beside `out` that becomes `out` only if the block succeeds (nothing half-written);
    `output`: check_output's key, marker and what."""
    check_output(out, overwrite, **output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (out.with_name(f".{out.name}.{tag}{os.getpid()}") for tag in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        normal_modes(tmp)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        if old.exists() and not out.exists():
            os.replace(old, out)  # put the previous output back
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()


class Clock:
    """Seconds per stage of a long job, for the record (metadata.json, trials.parquet) and its log line."""

    def __init__(self) -> None:
        import time

        self._now = time.perf_counter
        self._last = self._now()
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str) -> float:
        """The seconds since the previous lap (or the start), added to `stage`."""
        now = self._now()
        took, self._last = now - self._last, now
        self.seconds[stage] = self.seconds.get(stage, 0.0) + took
        return took

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.0f}s" for k, v in self.seconds.items())
