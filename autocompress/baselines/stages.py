"""compare's output folder: its stage cache (stages.json: each finished stage and the settings it was made with) and
the rule for an existing folder (docs/commands.md, "Outputs that exist")."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autocompress.errors import ConfigError
from autocompress.io import check_writable, log, write_json

STAGE_FILE = "stages.json"  # written when compare.out is made: what marks a folder as a comparison
FINAL_OUTPUTS = ("compare.json", "compare.md", "compare.parquet", "diffs.parquet", "diff.parquet")  # compare.json last


def _normal(key: Any) -> Any:
    """`key` as stages.json gives it back (tuples as lists, paths and other objects as strings), so keys compare equal."""
    return json.loads(json.dumps(key, default=str))


class Stages:
    """stages.json in the output folder: stage -> the settings it was made with; a stage whose key and folder match is skipped."""

    def __init__(self, out: Path) -> None:
        self.path = out / STAGE_FILE
        self.done: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.seconds: dict[str, float | str] = {}

    def finished(self, name: str, key: Any) -> bool:
        """Whether `name` was built with `key` (its target may since have gone: a carried comparison keeps small files only)."""
        return bool(self.done.get(name) == _normal(key))

    def run(self, name: str, key: Any, target: Path, build_fn: Callable[[], object], shared: bool = False) -> None:
        """Build `target` unless it was built with `key`. A `shared` target (used by other runs too) keeps its key beside it."""
        key = _normal(key)
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


def check_compare_out(out: Path, overwrite: bool) -> None:
    """compare.out is new, an unfinished comparison (resumed from its stages), or a finished one: refused unless
    `overwrite`. A folder of other files is refused either way."""
    if not out.exists():
        check_writable(out, "compare.out")
        return
    if not out.is_dir():
        raise ConfigError(f"compare.out={out} is a file; give a folder")
    if (out / "compare.json").exists():
        if not overwrite:
            raise ConfigError(
                f"{out} holds a finished comparison; choose another compare.out, or add overwrite=true to replace it "
                "(its finished stages with the same settings are reused)"
            )
    elif not (out / STAGE_FILE).exists() and any(out.iterdir()):
        raise ConfigError(f"compare.out={out} holds other files (no {STAGE_FILE}, not a comparison); choose another compare.out")
    check_writable(out, "compare.out")


def open_compare_out(out: Path) -> Stages:
    """Make compare.out (marked by its stages.json) and leave it unfinished: the old tables of a finished comparison go,
    so an interrupted rerun resumes and never shows them."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / STAGE_FILE).exists():
        write_json({}, out / STAGE_FILE)
    for name in FINAL_OUTPUTS:
        (out / name).unlink(missing_ok=True)
    return Stages(out)
