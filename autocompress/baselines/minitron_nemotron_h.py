"""Minitron on a Nemotron-H checkpoint with weights: the planner's shapes scored on text, the best one sliced.

`python -m autocompress.plan +scenario=NAME architecture.path=CHECKPOINT plan.weights=true data.source=jsonl
data.path=CORPUS`: the planner lays out ModelOpt's grid for hybrid models (global hidden size, Mamba heads and
head width, MLP width, depth; autocompress.plan) and keeps the feasible shapes with the most parameters; here,
as ModelOpt's `mcore_minitron` does with its `score_func`, the `top_k` of them are scored by KL to the unpruned
model on the selection split, with every unit ranked by activation importance on the calibration split
(autocompress.arch.nemotron_h_pruning), and the lowest is sliced into a checkpoint (report-split KL and
perplexity recorded). Scoring runs the cuts emulated on the unmodified model (`masked`); the written checkpoint
is checked against the same emulation. With `plan.rank=proxy` the same scoring takes AutoCompress's ranking
instead of parameters kept (autocompress.search.nemotron_h), and blocks go by their own drop KL instead of
1 - cosine: the two differ in which shapes are measured and in which blocks a depth cut drops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from autocompress.arch.hybrid import SHAPE_KEYS
from autocompress.config.families import NEMOTRON_H
from autocompress.config.schema import DataSpec
from autocompress.errors import ConfigError


@dataclass
class Scored:
    table: pd.DataFrame  # the scored shapes: their plan row, kl_select, chosen
    best: dict[str, int]  # the chosen shape
    kl_report: float
    perplexity_report: float
    importance: Any  # NemotronHImportance
    data: Any  # TokenData


def load(path: str | Path) -> tuple[Any, Any]:
    """A Nemotron-H checkpoint with weights (float32, eval) and its tokenizer, or one clear error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path).expanduser()
    if not any((folder / f).exists() for f in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")):
        raise ConfigError(f"plan.weights=true needs a checkpoint with weights at architecture.path={path} (no weight files there)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    if model.config.model_type != NEMOTRON_H:
        raise ConfigError(f"architecture.path={path} is a {model.config.model_type!r} model; plan.weights takes Nemotron-H checkpoints")
    return model, AutoTokenizer.from_pretrained(folder)


def kl_of(model: Any, kept: list[Any], tokens: torch.Tensor, desc: str = "") -> list[tuple[float, float]]:
    """(KL per token to the unpruned model, perplexity) of each emulated cut in `kept` on `tokens` [n, s]."""
    from autocompress.arch.nemotron_h_pruning import masked
    from autocompress.search.moe import kl_and_perplexity, logits_of

    with torch.no_grad():
        teacher = logits_of(model, tokens)
    out = []
    for k in tqdm(kept, desc=desc, disable=not desc):
        with masked(model, k):
            out.append(kl_and_perplexity(model, tokens, teacher))
    return out


def calibrate(model: Any, tokenizer: Any, data: DataSpec, progress: bool = True) -> tuple[Any, Any]:
    """The three splits' windows of `data` and activation importance on the calibration split."""
    from autocompress.arch.nemotron_h_pruning import importance
    from autocompress.model.data import load_token_data

    tokens = load_token_data(data, tokenizer)
    return tokens, importance(model, tokens.calib, progress=progress)


def score(model: Any, feasible: pd.DataFrame, top_k: int, tokens: Any, imp: Any, progress: bool = True) -> Scored:
    """The first `top_k` rows of `feasible` (in the planner's ranking) cut by `imp` and scored on the selection split; the best kept."""
    from autocompress.arch.nemotron_h_pruning import hybrid_of, kept_units

    desc = hybrid_of(model)
    rows = feasible.head(top_k).reset_index(drop=True)
    base = {k: int(v[0]) for k, v in desc.base_shape().items()}
    shapes = [base | {k: int(r[k]) for k in SHAPE_KEYS if k in r and k != "num_attention_heads"} for _, r in rows.iterrows()]
    kept = [kept_units(desc, imp, s) for s in shapes]
    scores = kl_of(model, kept, tokens.select, desc="score (selection split)" if progress else "")
    table = rows.assign(kl_select=[k for k, _ in scores], perplexity_select=[p for _, p in scores])
    best = int(table["kl_select"].idxmin())
    table["chosen"] = table.index == best
    (kl_report, ppl_report) = kl_of(model, [kept[best]], tokens.report)[0]
    return Scored(table, shapes[best], kl_report, ppl_report, imp, tokens)


def write(model: Any, tokenizer: Any, scored: Scored, out: Path, card: str) -> float:
    """The chosen shape sliced into `out` (a Nemotron-H checkpoint with the tokenizer); returns its max |logit difference|
    from the emulated cut on a few report windows (a mismatch beyond float rounding is refused)."""
    from autocompress.arch.nemotron_h_pruning import hybrid_of, kept_units, masked, slice_model

    pruned = slice_model(model, scored.best, scored.importance)
    ids = scored.data.report[:2]
    with torch.no_grad():
        with masked(model, kept_units(hybrid_of(model), scored.importance, scored.best)):
            emulated = model(input_ids=ids, use_cache=False).logits
        diff = float((pruned(input_ids=ids, use_cache=False).logits - emulated).abs().max())
    if diff > 1e-3:
        raise RuntimeError(f"the sliced checkpoint differs from the emulated cut by {diff:.3g} in its logits; not written")
    out.mkdir(parents=True, exist_ok=True)
    pruned.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(card + f"\n\nVerified: max |logit difference| from the emulated cut {diff:.3g}.\n", encoding="utf-8")
    (out / "pruning.json").write_text(json.dumps({"shape": scored.best, "kl_report": scored.kl_report}, indent=2) + "\n")
    return diff
