"""The Minitron baseline for hybrid Mamba-2 / attention / MoE models (GraniteMoeHybrid), as ModelOpt's `mcore_minitron` prunes them.

ModelOpt (nvidia-modelopt 0.47) prunes a hybrid MoE model along the hidden size, Mamba heads and head
dim, the routed-expert count, the expert FFN, the shared-expert FFN and depth, every width the same in
every layer. The GraniteMoeHybrid format ties the hidden size, Mamba heads and attention head dim
together (autocompress.arch.moe_pruning), so, as in AutoCompress's space for this family, the axes here
are: experts, expert FFN, shared-expert FFN, depth.

Importance on calibration windows, with ModelOpt's statistics:
- experts (per MoE block): the mean over the tokens routed to an expert of the L2 norm of its
  router-weighted output (`_register_sequential_mlp_importance`);
- expert and shared-expert FFN channels: per forward pass the mean |activation| at the down
  projection's input (per expert over its routed tokens; per sequence for the shared expert), squared,
  summed over passes, square root;
- layers: 1 - mean cosine(block input, block output), summed over passes; the lowest-scored are dropped,
  whatever their kind.
Candidates form ModelOpt's grid (autocompress.baselines.minitron.modelopt_choices): per width axis the
multiples of the search grid's step up to the base width, the top `max_width_pruning` share of them;
layer counts in multiples of 2, the top `max_depth_pruning` share. Every candidate that meets the
constraints under the sweep's hybrid roofline is kept, the `top_k` with the most parameters are scored
by KL to the unpruned model on the selection split, and the best is chosen; where the limits admit
nothing they are widened a level at a time as for dense models (`limit_levels`). Expert counts below
the router's top-k are not candidates (the router keeps its top-k). A candidate may keep no attention
layer, as ModelOpt's depth pruning allows (vLLM serves such a model; transformers runs it without a cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from autocompress.arch.importance import block_influence_hook, run_hooked, sequence_l2_part
from autocompress.arch.moe_pruning import MAMBA, MoEImportance, MoEShape, prune
from autocompress.baselines.minitron import LAYERS_DIVISOR, MinitronSpec, modelopt_choices, widen_limits
from autocompress.config.metrics import METRICS, Constraint
from autocompress.cost.hybrid import HybridCost, price
from autocompress.errors import InfeasibleError

LABEL = "Minitron (ModelOpt mcore_minitron, hybrid MoE axes)"


# --------------------------------------------------------------------------- importance


@torch.no_grad()
def modelopt_importance(model: Any, tokens: torch.Tensor, batch_size: int = 4) -> MoEImportance:
    """ModelOpt's importance statistics for a GraniteMoeHybrid model on `tokens` [n, seq_len] (see the module docstring)."""
    cfg = model.config
    layers = model.model.layers
    n = len(layers)
    expert_l2: list[torch.Tensor | None] = [None] * n
    expert_count: list[torch.Tensor | None] = [None] * n
    expert_ffn: list[torch.Tensor | None] = [None] * n
    shared = [torch.zeros(cfg.shared_intermediate_size, dtype=torch.float64) for _ in layers]
    blocks = torch.zeros(n, dtype=torch.float64)
    hooks = []

    def on_shared(i: int) -> Any:
        def hook(_: Any, args: Any) -> None:  # [b, s, ffn]: per sequence the mean |x| over tokens, squared, summed
            shared[i] += sequence_l2_part(args[0].detach())

        return hook

    def on_experts(i: int) -> Any:
        def hook(module: Any, args: Any, out: Any) -> None:
            x, index, weights = args[0], args[1], args[2]
            for e in range(module.num_experts):
                pos = (index == e).nonzero()
                if not len(pos):
                    continue
                rows, k = pos[:, 0], pos[:, 1]
                gate, up = F.linear(x[rows], module.gate_up_proj[e]).chunk(2, dim=-1)
                act = module.act_fn(gate) * up
                y = F.linear(act, module.down_proj[e]) * weights[rows, k, None]
                expert_l2[i][e] += float(torch.linalg.vector_norm(y.double(), dim=-1).sum())  # type: ignore[index]
                expert_count[i][e] += len(rows)  # type: ignore[index]
                expert_ffn[i][e] += act.double().abs().mean(0).pow(2)  # type: ignore[index]

        return hook

    for i, layer in enumerate(layers):
        hooks.append(layer.shared_mlp.output_linear.register_forward_pre_hook(on_shared(i)))
        hooks.append(layer.register_forward_hook(block_influence_hook(blocks, i), with_kwargs=True))
        moe = layer.block_sparse_moe
        if moe is not None:
            expert_l2[i] = torch.zeros(moe.experts.num_experts, dtype=torch.float64)
            expert_count[i] = torch.zeros(moe.experts.num_experts, dtype=torch.float64)
            expert_ffn[i] = torch.zeros(moe.experts.num_experts, cfg.intermediate_size, dtype=torch.float64)
            hooks.append(moe.experts.register_forward_hook(on_experts(i)))
    run_hooked(model, tokens, hooks, batch_size, "minitron importance", progress=False)
    experts = [None if s is None or c is None else s / (c + 1e-8) for s, c in zip(expert_l2, expert_count, strict=True)]
    return MoEImportance(
        experts=experts,
        expert_ffn=[None if f is None else f.sqrt() for f in expert_ffn],
        shared_ffn=[s.sqrt() for s in shared],
        layers=blocks,
        tokens=tokens.numel(),
        load=[(c / c.sum()).tolist() for c in expert_count if c is not None],
    )


# --------------------------------------------------------------------------- candidates


def modelopt_grid(config: Any, axes: dict[str, list[int]], width: float, depth: float) -> dict[str, list[int]]:
    """ModelOpt's choices per axis at the limits (`width`, `depth`); `axes`: the search grid (autocompress.search.moe.grid)."""

    def step(options: list[int]) -> int:
        return int(np.gcd.reduce([o for o in options if o > 0]))

    experts = [e for e in modelopt_choices(config.num_local_experts, step(axes["experts"]), width) if e >= config.num_experts_per_tok]
    return {
        "experts": experts,
        "expert_ffn": modelopt_choices(config.intermediate_size, step(axes["expert_ffn"]), width),
        "shared_ffn": modelopt_choices(config.shared_intermediate_size, step(axes["shared_ffn"]), width),
        "layers": modelopt_choices(config.num_hidden_layers, LAYERS_DIVISOR, depth),
    }


def kept_layers(scores: torch.Tensor, n_keep: int) -> tuple[int, ...]:
    """The `n_keep` highest-scored layers, in order: ModelOpt drops the lowest, whatever their kind (ties: the later layer goes)."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return tuple(sorted(order[:n_keep]))


@dataclass
class MoEMinitronResult:
    best: MoEShape
    importance: MoEImportance
    scored: pd.DataFrame  # the scored candidates: widths, layers, params, costs, kl, perplexity, limits, chosen
    feasible: int  # candidates meeting the constraints at the limits scored (each counted once)
    limits: dict[str, Any]  # the pick's max_width_pruning / max_depth_pruning, widened, tried


def search(
    model: Any,
    cost: HybridCost,
    constraints: tuple[Constraint, ...],
    calib: torch.Tensor,
    select: torch.Tensor,
    spec: MinitronSpec,
    progress: bool = True,
) -> MoEMinitronResult:
    """Minitron's pick for a GraniteMoeHybrid model: importance on `calib`, feasible candidates, the best of the top-k by KL on `select`."""
    from autocompress.search.moe import grid, kl_and_perplexity, logits_of

    cfg = model.config
    types = list(cfg.layer_types)
    imp = modelopt_importance(model, calib[: spec.importance_sequences])
    axes = grid(cfg)

    def found_at(width: float, depth: float) -> pd.DataFrame:
        g = modelopt_grid(cfg, axes, width, depth)
        shapes = [
            MoEShape(experts=e, expert_ffn=f, shared_ffn=s, layers=kept_layers(imp.layers, n_keep))
            for n_keep in g["layers"]
            for e in g["experts"]
            for f in g["expert_ffn"]
            for s in g["shared_ffn"]
        ]
        if not shapes:
            return pd.DataFrame()
        table = price(cost, types, shapes, constraints)
        ok = table[table["feasible"]]
        ok = ok.assign(shape=[shapes[k] for k in ok.index])
        sort = ["params", "n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size"]
        return ok.sort_values(sort, ascending=False, kind="stable")

    admitted, record = widen_limits(spec, found_at)
    if not admitted:
        bounds = ", ".join(c.describe() for c in constraints)
        raise InfeasibleError(f"no Minitron candidate of this hybrid model meets {bounds} at any pruning limit")
    where: dict[MoEShape, tuple[pd.Series, list[str]]] = {}
    for a in admitted:
        for _, row in a.candidates.head(spec.budget or spec.top_k).iterrows():
            where.setdefault(row["shape"], (row, []))[1].append(f"{a.width:g}/{a.depth:g}")
    scored = list(where.items())
    if spec.budget:  # the N with the most parameters over every pair (compare.minitron.budget), as for Llama-family runs
        scored = sorted(scored, key=lambda item: -int(item[1][0]["params"]))[: spec.budget]
    teacher = logits_of(model, select)
    rows = []
    for shape, (row, pairs) in tqdm(scored, desc="minitron candidates", disable=not progress):
        kl, ppl = kl_and_perplexity(prune(model, shape, imp), select, teacher)
        rows.append(
            {
                "experts": shape.experts,
                "expert_ffn": shape.expert_ffn,
                "shared_ffn": shape.shared_ffn,
                "layers": list(shape.layers),
                "layers_kept": len(shape.layers),
                "mamba_layers": sum(types[i] in MAMBA for i in shape.layers),
                "params": int(row["params"]),
                "active_params": int(row["active_params"]),
                **{k: float(row[k]) for k in METRICS},
                "kl": kl,
                "perplexity": ppl,
                "limits": pairs,
            }
        )
    scored = pd.DataFrame(rows).sort_values("params", ascending=False, kind="stable").reset_index(drop=True)
    best = int(scored["kl"].idxmin())
    scored["chosen"] = scored.index == best
    pick = scored.loc[best]
    width, depth = (float(x) for x in pick["limits"][0].split("/"))
    limits = {"max_width_pruning": width, "max_depth_pruning": depth, **record}
    shape = MoEShape(
        experts=int(pick["experts"]), expert_ffn=int(pick["expert_ffn"]), shared_ffn=int(pick["shared_ffn"]), layers=tuple(pick["layers"])
    )
    feasible = len({cand for a in admitted for cand in a.candidates["shape"]})
    return MoEMinitronResult(shape, imp, scored, feasible, limits)


def pick(ctx: Any, spec: MinitronSpec) -> Any:
    """Minitron's pick for a hybrid-MoE run behind the baseline interface (PickContext -> Pick): `search` on
    `spec.score_sequences` of the selection split; the pruned module writes its own checkpoint and reports its own KL."""
    from autocompress.baselines.interface import Pick
    from autocompress.checkpoints.moe_export import reload_checked
    from autocompress.io import staged
    from autocompress.search.moe import kl_and_perplexity, logits_of

    model = ctx.model
    res = search(model, ctx.cost_model.cost, ctx.constraints, ctx.calib, ctx.select[: spec.score_sequences], spec, ctx.progress)
    pruned = prune(model, res.best, res.importance)
    arch = ctx.cost_model.arch(res.best)
    dropped = [i for i in range(model.config.num_hidden_layers) if i not in res.best.layers]
    lim = res.limits
    description = (
        f"{res.best.experts} routed experts of FFN {res.best.expert_ffn}, shared expert {res.best.shared_ffn}, dropped layers "
        f"{dropped or 'none'}; {arch.params:,} parameters; best selection-split KL of the top {spec.top_k} per limit pair, "
        f"{len(res.scored)} scored of {res.feasible} feasible (limits {lim['max_width_pruning']} / {lim['max_depth_pruning']}"
        f"{', widened beyond ModelOpt defaults' if lim['widened'] else ''})"
    )

    def write(folder: Path, card: str) -> None:
        with staged(folder, overwrite=True) as tmp:
            pruned.save_pretrained(tmp)
            ctx.tokenizer.save_pretrained(tmp)
            reload_checked(pruned, tmp, ctx.check_ids[:2, :16])
            (tmp / "README.md").write_text(card + "\n", encoding="utf-8")

    cfg = model.config
    shape = {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "ffn": res.best.expert_ffn,
        "experts": res.best.experts,
        "expert_ffn": res.best.expert_ffn,
        "shared_ffn": res.best.shared_ffn,
        "dropped_blocks": dropped,
    }
    return Pick(
        arch,
        None,
        LABEL,
        float(res.scored.loc[res.scored["chosen"], "kl"].iloc[0]),
        notes={"feasible_candidates": res.feasible, "limits": res.limits},
        shape=shape,
        description=description,
        table_label=f"{LABEL}: {len(res.best.layers)} layers, {res.best.experts} experts",
        tables={"candidates": res.scored},
        write=write,
        report=lambda tokens: kl_and_perplexity(pruned, tokens, logits_of(model, tokens)),
    )
