"""AutoCompress's ranking of Nemotron-H shapes with weights (`plan.rank=proxy`): Puzzle-style single-change scores.

The planner's grid (autocompress.plan: one value per global width, a number of blocks of each kind)
holds thousands to millions of feasible shapes; ModelOpt's Minitron takes the ones with the most
parameters to its score function (`plan.rank=params`). Here every single change is measured on its
own instead, as the hybrid-MoE search scores its changes (autocompress.search.moe), around an anchor
shape: the calibration-split KL to the unpruned model of the anchor with one axis moved to each of its
options (each width; each count of Mamba-2 / MoE blocks kept), minus the anchor's. A shape's proxy is
the anchor's KL plus its changes' deltas. Which blocks a count drops: those whose own drop (from the
unpruned model) cost the least KL, instead of Minitron's 1 - cosine. The first anchor is the unpruned
model; each further round (`plan.rounds`) re-anchors at the best feasible shape of the previous one, so
the deltas are taken where the bounds force the model to be, not at the unpruned model (changes
interact: in the tiny Nemotron-H, fewer Mamba heads cost KL from the unpruned model but lowered it at
hidden 80 with two Mamba blocks dropped). The `top_k` best by the last proxy are then measured on the
selection split exactly as Minitron's candidates are (baselines.minitron_nemotron_h).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from autocompress.arch.hybrid import KINDS, HybridModel
from autocompress.arch.nemotron_h_pruning import NemotronHImportance, kept_units, masked
from autocompress.search.moe import kl_and_perplexity, logits_of

DROPPABLE = ("mamba", "moe")  # the kinds the planner drops blocks of (attention and MLP blocks are kept)
AXES = ("hidden_size", "mamba_num_heads", "mamba_head_dim", "intermediate_size")  # the width axes the pruner slices


class SingleChanges:
    """Calibration KL of single changes around an anchor shape, measured on demand; ranks planner tables by anchor + deltas."""

    def __init__(self, model: Any, desc: HybridModel, imp: NemotronHImportance, tokens: torch.Tensor, progress: bool = True) -> None:
        self.model, self.desc, self.tokens, self.progress = model, desc, tokens, progress
        with torch.no_grad():
            self.teacher = logits_of(model, tokens)
        self.base = {k: int(v[0]) for k, v in desc.base_shape().items()}
        pattern = desc.hybrid_override_pattern
        self.blocks = {i: kind for i, c in enumerate(pattern) if (kind := KINDS[c]) in DROPPABLE}
        drops = {}
        for i, kind in tqdm(self.blocks.items(), desc="single changes: blocks", disable=not progress):
            alone = torch.ones_like(imp.blocks)
            alone[i] = 0.0  # kept_units keeps the highest block scores: this block goes first
            drops[i] = self._measure(replace(imp, blocks=alone), self.base | {f"{kind}_layers": desc.count(kind) - 1})
        self.drops = drops
        blocks = imp.blocks.clone()
        for i, kl in drops.items():
            blocks[i] = kl
        self.imp = replace(imp, blocks=blocks)  # what every shape here is cut with (and what the pick is sliced with)
        self.anchor, self.anchor_kl = dict(self.base), 0.0
        self.delta: dict[tuple[str, int], float] = {}
        self.measured = len(drops)
        self.keys = (*AXES, *(f"{kind}_layers" for kind in DROPPABLE))  # what a shape's proxy sums over

    def release(self) -> None:
        """Drop the calibration teacher's logits (windows x tokens x vocabulary floats) once the rounds are done."""
        self.teacher = torch.empty(0)

    def _measure(self, imp: NemotronHImportance, shape: Mapping[str, int]) -> float:
        with masked(self.model, kept_units(self.desc, imp, shape)):
            return kl_and_perplexity(self.model, self.tokens, self.teacher)[0]

    def anchor_at(self, shape: Mapping[str, Any]) -> None:
        """Take further deltas around `shape` (a planner row); measured afresh by `prepare`."""
        self.anchor = {k: int(shape[k]) for k in self.base}
        self.anchor_kl = self._measure(self.imp, self.anchor)
        self.delta = {}
        self.measured += 1

    def prepare(self, options: Mapping[str, Iterable[int]]) -> None:
        """Measure each option in `options` (axis -> values: the widths and block counts that feasible shapes take) not measured yet."""
        todo = sorted({(a, int(v)) for a in self.keys for v in options.get(a, ()) if int(v) != self.anchor[a]} - self.delta.keys())
        for axis, value in tqdm(todo, desc="single changes: widths and depth", disable=not self.progress or not todo):
            self.delta[(axis, value)] = self._measure(self.imp, self.anchor | {axis: value}) - self.anchor_kl
        self.measured += len(todo)

    def __call__(self, table: pd.DataFrame) -> np.ndarray:
        """The proxy of every row of a planner table (its options measured by `prepare`)."""
        total = np.full(len(table), self.anchor_kl)
        for axis in self.keys:
            lookup = {v: d for (a, v), d in self.delta.items() if a == axis} | {self.anchor[axis]: 0.0}
            part = table[axis].astype(int).map(lookup).to_numpy(dtype=float)
            if np.isnan(part).any():
                raise RuntimeError(f"{axis} takes a value whose single change was not measured (prepare the options first)")
            total += part
        return total
