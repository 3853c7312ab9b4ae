"""The Minitron baseline, as NVIDIA Model Optimizer's `mcore_minitron` mode prunes: homogeneous shapes under the scenario's constraints.

Importance on calibration text (ModelOpt's aggregation: per sequence the mean |activation| over
tokens, then the L2 norm over sequences):
- hidden channels: the outputs of every layer's two RMSNorms (the norms fused into QKV and FC1 in
  Megatron), each norm's L2 score summed over norms;
- FFN neurons: the input of each layer's down projection, act(gate(x)) * up(x);
- blocks (depth): sum over batches of 1 - mean cosine(block input, block output); the lowest are dropped.
Query heads are not pruned in this project's space and KV heads are mean-pooled in groups (as the
search does), so heads need no ranking. Candidates are every homogeneous shape on the search
space's divisors (one hidden size, one KV-head count and FFN width for all kept layers, the d least
important blocks dropped whole; layer 0 never, vLLM 0.32 cannot serve that) that meets every
constraint under the same cost model; the `top_k` with the most parameters are scored by KL to the
unpruned model on calibration text (ModelOpt's `score_func`) and the best one is kept.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from autocompress.arch import Architecture, Block, SearchSpace
from autocompress.config import Constraint
from autocompress.cost import CostModel
from autocompress.errors import ConfigError, InfeasibleError
from autocompress.masking import MaskedModel, Ranking
from autocompress.search import evaluate


@dataclass(frozen=True)
class MinitronSpec:
    """ModelOpt's search settings (conf/compare/default.yaml, `compare.minitron`)."""

    top_k: int = 10  # candidates (most parameters first) scored on calibration text
    max_width_pruning: float | None = None  # widths >= (1 - this) x base; None = the search space's own bounds
    max_depth_pruning: float = 0.5  # at most this share of the layers dropped (ModelOpt's default 0.2)
    importance_sequences: int = 16  # calibration sequences for the activation importance
    score_sequences: int = 8  # held-out calibration sequences for the score (KL to the unpruned model)

    def __post_init__(self) -> None:
        for key in ("top_k", "importance_sequences", "score_sequences"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"compare.minitron.{key} must be > 0, got {getattr(self, key)!r}")
        if self.max_width_pruning is not None and not 0 <= self.max_width_pruning < 1:
            raise ConfigError(f"compare.minitron.max_width_pruning must be in [0, 1) or null, got {self.max_width_pruning!r}")
        if not 0 <= self.max_depth_pruning < 1:
            raise ConfigError(f"compare.minitron.max_depth_pruning must be in [0, 1), got {self.max_depth_pruning!r}")


@dataclass
class Importance:
    hidden: torch.Tensor  # [d]
    ffn: torch.Tensor  # [L, i]
    blocks: torch.Tensor  # [L], higher = more important

    def ranking(self) -> Ranking:
        return Ranking(
            hidden=torch.argsort(self.hidden, descending=True, stable=True),
            ffn=torch.argsort(self.ffn, dim=1, descending=True, stable=True),
        )

    def drop_order(self) -> list[int]:
        """Layers from least to most important, layer 0 excluded (it always keeps its attention)."""
        return [int(i) for i in torch.argsort(self.blocks, stable=True) if int(i) != 0]


@torch.no_grad()
def importance(model: Any, tokens: torch.Tensor, batch_size: int = 4, progress: bool = True) -> Importance:
    """Minitron activation importance of hidden channels, FFN neurons and blocks on `tokens` [n, s]."""
    layers = model.model.layers
    n_layers, d, inter = len(layers), model.config.hidden_size, model.config.intermediate_size
    norm_sq = torch.zeros(2 * n_layers, d, dtype=torch.float64)  # per norm: sum over sequences of (mean_s |x|)^2
    ffn_sq = torch.zeros(n_layers, inter, dtype=torch.float64)
    blocks = torch.zeros(n_layers, dtype=torch.float64)

    def l2_part(x: torch.Tensor) -> torch.Tensor:  # [b, s, c] -> [c]: sum over b of (mean over s of |x|)^2
        return x.float().abs().mean(dim=1).pow(2).sum(dim=0).double()

    def on_norm(slot: int) -> Any:
        def hook(module: Any, args: Any, out: torch.Tensor) -> None:  # returns None: the output stays as it is
            norm_sq[slot].add_(l2_part(out))

        return hook

    def on_ffn(idx: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            ffn_sq[idx].add_(l2_part(args[0]))

        return hook

    def on_block(idx: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any, out: Any) -> None:
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            y = out[0] if isinstance(out, tuple) else out
            blocks[idx] += float(1 - F.cosine_similarity(x.float(), y.float(), dim=-1).mean())

        return hook

    handles = []
    for idx, layer in enumerate(layers):
        handles.append(layer.input_layernorm.register_forward_hook(on_norm(2 * idx)))
        handles.append(layer.post_attention_layernorm.register_forward_hook(on_norm(2 * idx + 1)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(on_ffn(idx)))
        handles.append(layer.register_forward_hook(on_block(idx), with_kwargs=True))
    try:
        for start in tqdm(range(0, len(tokens), batch_size), desc="minitron importance", disable=not progress):
            model.model(input_ids=tokens[start : start + batch_size], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return Importance(hidden=norm_sq.sqrt().sum(0), ffn=ffn_sq.sqrt(), blocks=blocks)


# --------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    """A homogeneous architecture: every kept layer has `kv_heads` and `ffn`; `dropped` blocks are no-op entirely."""

    arch: Architecture
    hidden: int
    kv_heads: int
    ffn: int
    dropped: tuple[int, ...]
    params: int
    costs: dict[str, float]


def homogeneous(space: SearchSpace, hidden: int, kv_heads: int, ffn: int, dropped: tuple[int, ...]) -> Architecture:
    blocks = tuple(Block(0, 0) if i in dropped else Block(kv_heads, ffn) for i in range(space.num_layers))
    return dataclasses.replace(space.base, hidden_size=hidden, blocks=blocks)


def _widths(options: tuple[int, ...], base: int, max_pruning: float | None) -> list[int]:
    floor = 0.0 if max_pruning is None else (1 - max_pruning) * base
    return [o for o in options if o > 0 and o >= floor - 1e-9]


def enumerate_candidates(
    space: SearchSpace, drop_order: list[int], cost_model: CostModel, constraints: tuple[Constraint, ...], spec: MinitronSpec
) -> list[Candidate]:
    """Every homogeneous candidate that meets all `constraints`, most parameters first."""
    base = space.base.blocks[0]
    depth_ok = 0 in space.attention and 0 in space.ffn
    max_drop = min(int(spec.max_depth_pruning * space.num_layers), len(drop_order)) if depth_ok else 0
    grid = itertools.product(
        _widths(space.hidden, space.base.hidden_size, spec.max_width_pruning),
        _widths(space.attention, base.kv_heads, spec.max_width_pruning),
        _widths(space.ffn, base.ffn, spec.max_width_pruning),
        range(max_drop + 1),
    )
    found = []
    for hidden, kv, ffn, n_drop in grid:
        dropped = tuple(sorted(drop_order[:n_drop]))
        arch = homogeneous(space, hidden, kv, ffn, dropped)
        costs = cost_model.predict(arch)
        if all(c.satisfied(costs[c.metric]) for c in constraints):
            found.append(Candidate(arch, hidden, kv, ffn, dropped, arch.num_params(), costs))
    found.sort(key=lambda c: (-c.params, -c.hidden, -c.kv_heads, -c.ffn, len(c.dropped)))
    return found


@dataclass
class MinitronResult:
    best: Candidate
    ranking: Ranking
    importance: Importance
    scored: pd.DataFrame  # the top-k: hidden, kv_heads, ffn, dropped, params, costs, kl, perplexity, chosen
    feasible: int  # homogeneous candidates that meet the constraints


def search(
    model: Any,
    space: SearchSpace,
    cost_model: CostModel,
    constraints: tuple[Constraint, ...],
    calib: torch.Tensor,
    score_tokens: torch.Tensor,
    teacher_score: torch.Tensor,
    spec: MinitronSpec,
    progress: bool = True,
) -> MinitronResult:
    """Minitron's pick: importance on `calib`, the feasible homogeneous candidates, the best of the top-k by KL on `score_tokens`.

    `teacher_score` [n, s, d]: the unpruned model's final hidden states on `score_tokens`.
    """
    imp = importance(model, calib[: spec.importance_sequences], progress=progress)
    ranking = imp.ranking()
    found = enumerate_candidates(space, imp.drop_order(), cost_model, constraints, spec)
    if not found:
        bounds = ", ".join(c.describe() for c in constraints)
        raise InfeasibleError(
            f"no homogeneous architecture on the search space's divisors meets {bounds}; "
            "raise compare.minitron.max_depth_pruning or max_width_pruning (null = the search space's bounds)"
        )
    masked = MaskedModel(model, space, ranking)
    rows = []
    try:
        for cand in tqdm(found[: spec.top_k], desc="minitron candidates", disable=not progress):
            kl, ppl = evaluate(model, masked, cand.arch, score_tokens, teacher_score)
            rows.append(
                {
                    "hidden": cand.hidden,
                    "kv_heads": cand.kv_heads,
                    "ffn": cand.ffn,
                    "dropped": list(cand.dropped),
                    "layers_kept": space.num_layers - len(cand.dropped),
                    "params": cand.params,
                    **cand.costs,
                    "kl": kl,
                    "perplexity": ppl,
                    "architecture": cand.arch.to_json(),
                }
            )
    finally:
        masked.remove()
    scored = pd.DataFrame(rows)
    best_row = int(scored["kl"].idxmin())
    scored["chosen"] = scored.index == best_row
    return MinitronResult(found[best_row], ranking, imp, scored, len(found))


# --------------------------------------------------------------------------- checkpoint


def write_checkpoint(
    model: Any, tokenizer: Any, space: SearchSpace, ranking: Ranking, arch: Architecture, out: Path, ids: torch.Tensor, card: str
) -> str:
    """The pruned checkpoint through the export's own code (slicing, DeciLM/Llama format, verification); returns the format."""
    from autocompress.export import staged, verify_export, write_weights

    with staged(out, overwrite=True) as tmp:
        fmt = write_weights(model, arch, ranking, tmp)
        model.generation_config.save_pretrained(tmp)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        check, _, _ = verify_export(tmp, model, space, ranking, arch, ids)
        (tmp / "README.md").write_text(
            card + f"\n\nVerified: max |logit difference| from the masked model {check.max_abs_logit_diff:.3g}.\n", encoding="utf-8"
        )
    return fmt
