"""What the benchmarks share (a module, not a benchmark: nothing here runs on its own). A benchmark run as
`python benchmarks/NAME.py` finds it beside itself, and importing it checks that the `autocompress` imported is this
tree's: a benchmark run from a `git worktree` at a recorded commit must measure that commit's code, not the package
installed from another checkout (set PYTHONPATH=<the worktree>)."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import autocompress
from autocompress.arch.masking import MaskedModel
from autocompress.arch.space import Architecture
from autocompress.config import cpuinfo
from autocompress.config.schema import LagrangianSettings
from autocompress.cost import CostModel
from autocompress.cost.base import meets
from autocompress.search.differentiable import SearchInputs, evaluate

TREE = Path(__file__).resolve().parents[1]
if Path(autocompress.__file__).resolve().parents[1] != TREE:
    raise SystemExit(
        f"error: this benchmark is in {TREE} but imports autocompress from {Path(autocompress.__file__).resolve().parent}; "
        f"run it with PYTHONPATH={TREE}"
    )


def _cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of every process now running, by pid (Linux /proc; empty elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            out[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out


def _own_tree() -> set[int]:
    """This process and every process below it (a local Ray cluster it started, vLLM engines, pytest workers)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += parents.get(pid, [])
    return tree


class Record:
    """The conditions of one benchmark run, for its result file (issue 44: every result records its commit, CPU, date
    and whether the machine was shared). Start it before the work and call `as_dict()` when writing: `shared` is
    measured, not declared: the CPU seconds that processes outside this run's own process tree used meanwhile, per
    second of wall time (`others_cores`; a process that started and ended in between is missed), or a `note` naming
    what ran beside it."""

    def __init__(self, note: str | None = None) -> None:
        self.note = note
        self.started = time.time()
        self.date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.before = _cpu_seconds()
        # the code as the run started (a commit made while a long run goes on, or a clone made at its start, is not it)
        git = ["git", "-C", str(TREE)]
        sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
        self.commit = sha + ("+uncommitted" if dirty else "")

    def as_dict(self) -> dict[str, Any]:
        wall = max(time.time() - self.started, 1e-9)
        mine = _own_tree()
        others = sum(max(t - self.before.get(pid, 0.0), 0.0) for pid, t in _cpu_seconds().items() if pid not in mine)
        cores = others / wall
        ident = cpuinfo.identity()
        return {
            "commit": self.commit,
            "cpu": f"{ident['model']} ({ident['simd'] or 'no AVX2 or AVX-512'}, {ident['cores']} cores)",
            "date": self.date,
            "wall_s": round(wall, 1),
            "shared": cores >= 0.1 or bool(self.note),
            "others_cores": round(cores, 2),
            "shared_with": self.note,
        }


# the Lagrangian settings search_quality and search_ablation search with
SETTINGS = [
    LagrangianSettings(margin=0.0, dual_lr=2.0),
    LagrangianSettings(margin=0.1, dual_lr=0.5),
    LagrangianSettings(margin=0.0, dual_lr=0.5, seed=1),
]


def shape(arch: Architecture) -> dict[str, Any]:
    """Per-layer shape strings: attention 'KV heads' or '-', FFN widths."""
    return {
        "hidden": arch.hidden_size,
        "query_heads": arch.num_attention_heads,
        "attention": "".join(str(b.kv_heads) if b.kv_heads else "-" for b in arch.blocks),
        "ffn": [b.ffn for b in arch.blocks],
    }


def scored(
    model: Any,
    masked: MaskedModel,
    inputs: SearchInputs,
    cm: CostModel,
    arch: Architecture,
    extra: dict[str, Any] | None = None,
    report: bool = True,
) -> dict[str, Any]:
    """Selection- and (unless `report` is False) report-split KL of `arch`, its feasibility, costs and shape."""
    kl_sel, _ = evaluate(model, masked, arch, inputs.select, inputs.teacher_select)
    kl, ppl = evaluate(model, masked, arch, inputs.report, inputs.teacher_report) if report else (float("nan"), float("nan"))
    row = {"kl": kl, "kl_select": kl_sel, "perplexity": ppl, "params": arch.num_params(), "feasible": meets(cm, inputs.constraints, arch)}
    return row | cm.predict(arch) | shape(arch) | (extra or {})


def dual_steps(definition: Mapping[str, Any]) -> list[float]:
    """The sweep grid's dual steps (conf/sweep/definition/grid.yaml): each is searched at margin 0 with seeds base
    and base + 1, as the default sweep runs them."""
    steps = definition.get("grid", {}).get("dual_lr") if definition.get("searcher") == "grid" else None
    if not steps:
        raise SystemExit("search_levers takes its dual steps from the sweep grid; use sweep/definition=grid with grid.dual_lr set")
    return [float(d) for d in steps]


def run_logged(cmd: list[str], log: Path, cwd: Path, rerun: str = "") -> float:
    """`cmd` run in `cwd`, its output appended to `log`; the seconds it took. A failure stops the benchmark with one line
    naming the command and the log (`rerun`: what rerunning does, added to that line)."""
    start = time.time()
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode:
        raise SystemExit(f"error: failed ({proc.returncode}): {' '.join(cmd)}; see {log}" + (f" ({rerun})" if rerun else ""))
    return time.time() - start
