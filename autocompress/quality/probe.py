"""Picking among top candidates after a short distillation (`compare.probe`), for both methods alike.

The Minitron paper retrains its top candidates lightly before the final choice (ModelOpt's
`mcore_minitron` skips this and picks by the score before any training). With
`compare.probe.candidates=N`, compare takes each method's N best candidates by selection-split KL
before distillation, distils each for `compare.probe.tokens` tokens (the distill/ settings otherwise:
same optimiser, seed and calibration text), measures KL to the unpruned model on the selection
split again, and keeps the lowest. The report split is never looked at for the choice. By default N is
DEFAULT_CANDIDATES for a Llama-family run and 0 (off) for a hybrid-MoE run; 0 turns it off.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autocompress.config.schema import DataSpec
from autocompress.errors import ConfigError
from autocompress.io import log
from autocompress.quality.distillation import DistillSpec, distill, heldout_kl

# In five compares at 96 search steps the probe moved AutoCompress's pick twice, each to a better result, and kept
# every other pick (docs/benchmarks.md, "picking after a short distillation of the top candidates").
DEFAULT_CANDIDATES = 3


@dataclass(frozen=True)
class ProbeSpec:
    """conf/compare/default.yaml, compare.probe."""

    candidates: int | None = None  # per method: its top-N by selection-split KL before distillation; 0 = off (pick by that KL);
    # None = DEFAULT_CANDIDATES for a Llama-family run, off for a hybrid-MoE one (the probe picks among Llama-family candidates only)
    tokens: int = 16384  # distillation tokens per candidate

    def __post_init__(self) -> None:
        if self.candidates is not None and (self.candidates < 0 or self.candidates == 1):
            raise ConfigError(f"compare.probe.candidates must be 0 (off), >= 2 or null (the default), got {self.candidates!r}")
        if self.tokens <= 0:
            raise ConfigError(f"compare.probe.tokens must be > 0, got {self.tokens!r}")

    @property
    def on(self) -> bool:
        """Whether the probe runs; a default (None) not yet resolved for the run's family counts as off."""
        return bool(self.candidates)

    @property
    def count(self) -> int:
        """Candidates per method (0 while off or not yet resolved)."""
        return self.candidates or 0

    def resolved(self, hybrid: bool) -> ProbeSpec:
        """The setting for a run of this family: the default becomes DEFAULT_CANDIDATES, or 0 for a hybrid-MoE run."""
        if self.candidates is not None:
            return self
        return dataclasses.replace(self, candidates=0 if hybrid else DEFAULT_CANDIDATES)

    def distill_spec(self, base: DistillSpec) -> DistillSpec:
        """The compare's distillation settings at the probe's budget (resumable saves are pointless at this size)."""
        spec = dataclasses.replace(base, tokens=self.tokens)
        return dataclasses.replace(spec, save_every=spec.steps + 1)


def probe(
    candidates: dict[str, Callable[[Path], object]],
    work: Path,
    teacher: Any,
    tokenizer: Any,
    data: DataSpec,
    spec: DistillSpec,
    select: torch.Tensor,
    evaluation_dirs: tuple[Path, ...],
) -> list[dict[str, Any]]:
    """Write each candidate's checkpoint (its writer gets the folder), distil it, measure selection-split KL; one row each.

    The checkpoints are removed once measured (they are the size of the model); the rows keep what was measured.
    """
    from autocompress.model.checkpoint import open_model

    rows = []
    for i, (name, write) in enumerate(candidates.items()):
        folder = work / f"candidate{i}"
        shutil.rmtree(folder, ignore_errors=True)
        start = time.time()
        write(folder / "pruned")
        res = distill(
            folder / "pruned", folder / "distilled", teacher, tokenizer, data, spec, overwrite=True, resume=False,
            evaluation_dirs=evaluation_dirs,
        )  # fmt: skip
        student = open_model(folder / "distilled").eval()
        with torch.no_grad():
            kl = heldout_kl(student, teacher, select)
        rows.append({"candidate": name, "kl_select_probe": kl, "probe_tokens": res.tokens, "seconds": time.time() - start})
        log(f"probe {i + 1}/{len(candidates)} {name}: selection-split KL after {res.tokens:,} tokens {kl:.4f}")
        del student
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def chosen(rows: list[dict[str, Any]]) -> str:
    """The candidate with the lowest selection-split KL after the probe (the first on ties)."""
    return min(rows, key=lambda r: r["kl_select_probe"])["candidate"]
