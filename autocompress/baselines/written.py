"""A baseline pick's checkpoints: scored on the report split and written (the teacher sliced by the pick's ranking, or
the pick's own writer), and written again from its record (`<name>.json` + `ranking.safetensors`) when a comparison
lost its large files (a carried one keeps its small files only) but was picked already."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from autocompress.baselines.context import Context, arch_of

RANKING = "ranking.safetensors"  # a baseline's unit order, kept beside <name>.json so its checkpoints can be made again


class ReportSplit:
    """A pick's report-split KL and perplexity and its checkpoint: the teacher sliced by the pick's ranking (or the pick's
    own `report` / `write`); the teacher's report-split hidden states computed once for all the picks of a stage."""

    def __init__(self, ctx: Context) -> None:
        self.ctx, self.tokens = ctx, ctx.data.report
        self._teacher: Any = None

    def scored_and_written(self, name: str, pick: Any, folder: Path, card: str) -> dict[str, float]:
        from autocompress.arch.importance import teacher_hidden
        from autocompress.arch.masking import MaskedModel
        from autocompress.baselines.minitron import write_checkpoint
        from autocompress.search.differentiable import evaluate

        ctx, ranking = self.ctx, pick.ranking
        if ranking is None and (pick.report is None or pick.write is None):
            raise TypeError(f"baseline {name!r}: a pick without a ranking must write its checkpoint and report its KL itself")
        if pick.report is not None:
            kl, ppl = pick.report(self.tokens)
        else:
            if self._teacher is None:
                self._teacher = teacher_hidden(ctx.model, self.tokens, desc="teacher (report)")
            masked = MaskedModel(ctx.model, ctx.space, ranking)
            try:
                kl, ppl = evaluate(ctx.model, masked, pick.arch, self.tokens, self._teacher)
            finally:
                masked.remove()
        if pick.write is not None:
            pick.write(folder, card)
        else:
            write_checkpoint(ctx.model, ctx.tokenizer, ctx.space, ranking, pick.arch, folder, self.tokens[:4], card)
        return {"kl_report": kl, "perplexity_report": ppl}


def keep_ranking(pick: Any, out: Path) -> None:
    """Save the ranking that slices the pick and its runner-up (both, or neither: a pick that writes its own checkpoint,
    or a runner-up ranked otherwise, is not sliced again); an earlier pick's ranking there goes either way."""
    (out / RANKING).unlink(missing_ok=True)
    up = pick.runner_up
    same = up is None or (up.write is None and up.ranking is not None and up.ranking.same_as(pick.ranking))
    if pick.ranking is not None and pick.write is None and same:
        pick.ranking.save(out / RANKING)


def _checkpoints(folder: Path, summary: dict[str, Any]) -> list[tuple[dict[str, Any], Path]]:
    """(record, checkpoint folder) of the runner-up (when there is one), then the pick: the pick's folder, written last,
    marks the stage's target."""
    up = [(summary["runner_up"], folder / "runner_up" / "pruned")] if summary.get("runner_up") else []
    return [*up, (summary, folder / "pruned")]


def checkpoints_complete(folder: Path, name: str) -> bool:
    """Whether every checkpoint `<name>.json` records (pick, runner-up) is in `folder`."""
    done = folder / f"{name}.json"
    return done.exists() and all(path.exists() for _, path in _checkpoints(folder, json.loads(done.read_text())))


def rewrite_checkpoints(ctx: Context, folder: Path, name: str) -> bool:
    """Make a baseline's checkpoints (its runner-up's, then its pick's) again from `<name>.json` and its ranking, without
    picking again; False where they cannot be (no ranking kept: a pick that writes its own checkpoint, or an older one)."""
    from autocompress.arch.masking import Ranking
    from autocompress.baselines.minitron import write_checkpoint

    done = folder / f"{name}.json"
    if not (folder / RANKING).exists() or not done.exists():
        return False
    summary, ranking = json.loads(done.read_text()), Ranking.load(folder / RANKING)
    shutil.rmtree(folder / "pruned", ignore_errors=True)  # the stage's target: present only once all are written again
    for pick, path in _checkpoints(folder, summary):
        arch = arch_of(ctx, pick["architecture"])
        write_checkpoint(ctx.model, ctx.tokenizer, ctx.space, ranking, arch, path, ctx.data.report[:4], pick["card"])
    return True
