"""`python -m autocompress.plan +scenario=b200_longctx`: which pruned shapes of a hybrid MoE model fit a deployment, with no weights.

The cost-model side of the search for a model known only by its architecture (default: Nemotron 3
Super 120B-A12B, conf/architecture/): every shape of a Minitron-style grid (global widths and
depth, ModelOpt's limits and divisors; conf/plan.yaml) is priced by the hybrid roofline
(autocompress.cost.hybrid); the feasible ones (every scenario constraint met, relative bounds
taken against the unpruned model, and the device's memory share holding the workload) are ranked
by parameters kept, the order in which ModelOpt's Minitron takes candidates to its score
function. That ranking is an explicit prior, not a measurement: without weights every unit counts
as equally important (uniform importance), so more parameters kept ranks higher; a real search
ranks by distillation loss on calibration text (with weights: plan.weights, plan.rank). Writes
plan.parquet (the feasible shapes, most parameters first; with weights the pick first, then the
ranking's order), plan.md (the table and the memory accounting, line by line, of the unpruned model
and of the first shape), metadata.json and first_shape/config.json (a
weight-free Nemotron-H checkpoint of the first shape, for vLLM's load_format="dummy") under
results/<scenario>/plan-<run_id>/.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig

from autocompress.arch.hybrid import SHAPE_KEYS, WIDTHS, HybridModel, shape_config, write_config
from autocompress.baselines.minitron import modelopt_choices
from autocompress.config.build import build, overwrite_flag, results_of, scenario_from_dict
from autocompress.config.cliargs import hydra_entry
from autocompress.config.cliargs import task as hydra_task
from autocompress.config.compose import plain
from autocompress.config.schema import DataSpec, Scenario
from autocompress.cost.hybrid import HybridCost, evaluate, hardware_terms
from autocompress.errors import ConfigError, InfeasibleError
from autocompress.io import check_output, log, markdown, staged, write_json, write_parquet, write_text
from autocompress.results.runfolder import git_sha

if TYPE_CHECKING:
    from autocompress.search.nemotron_h import SingleChanges

RANKS = ("params", "proxy")  # Minitron's order (parameters kept) or AutoCompress's (single-change KLs around an anchor; needs weights)
DIVISORS = ("hidden_size_divisor", "ffn_hidden_size_divisor", "mamba_head_dim_divisor", "num_moe_experts_divisor", "num_layers_divisor")
AXES = {  # width -> (the kind of block it belongs to, None: every block; its divisor's key, None: the Mamba groups)
    "hidden_size": (None, "hidden_size_divisor"),
    "mamba_num_heads": ("mamba", None),
    "mamba_head_dim": ("mamba", "mamba_head_dim_divisor"),
    "n_routed_experts": ("moe", "num_moe_experts_divisor"),
    "moe_intermediate_size": ("moe", "ffn_hidden_size_divisor"),
    "moe_shared_expert_intermediate_size": ("moe", "ffn_hidden_size_divisor"),
    "intermediate_size": ("mlp", "ffn_hidden_size_divisor"),
}


def axes(model: HybridModel, plan: Mapping[str, Any], width: float, depth: float) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """ModelOpt's choices of each width at limit `width`, and the (Mamba, MoE) blocks dropped at limit `depth`.

    Widths: `modelopt_choices` (multiples of the divisor and the full size, the top 1 - width of them),
    Mamba heads in multiples of the groups (ModelOpt's MambaNumHeadsHp); a width of blocks the model
    does not have stays as it is. Depth: the total layer count ModelOpt's way (multiples of
    num_layers_divisor), split every way between Mamba and MoE blocks (no weights to rank blocks by), at
    least one Mamba block kept.
    Query heads, KV heads, attention and dense MLP blocks are kept.
    """
    widths: dict[str, list[int]] = {}
    for key, (kind, divisor) in AXES.items():
        full = getattr(model, key)
        if (kind is not None and model.count(kind) == 0) or full == 0:
            widths[key] = [full]
            continue
        widths[key] = modelopt_choices(full, int(plan[divisor]) if divisor else model.n_groups, width)
    layers = len(model.hybrid_override_pattern)
    dropped = sorted({layers - keep for keep in modelopt_choices(layers, int(plan["num_layers_divisor"]), depth)})
    m, e = model.count("mamba"), model.count("moe")
    most = max(m - 1, 0)  # one Mamba block stays: vLLM's NemotronH refuses a model without one ("no mamba layers")
    drops = [(a, t - a) for t in dropped for a in range(0, min(t, most) + 1) if t - a <= e]
    return widths, drops


def shapes(model: HybridModel, widths: Mapping[str, list[int]], drops: list[tuple[int, int]]) -> Iterator[dict[str, np.ndarray]]:
    """The grid as chunks of equal-length arrays, one per (hidden size, Mamba heads) pair (the grid is too big for one)."""
    outer = ("hidden_size", "mamba_num_heads")
    rest = [k for k in widths if k not in outer]
    drop = np.array(drops, dtype=np.int64).reshape(-1, 2)
    for hidden, heads in itertools.product(*(widths[k] for k in outer)):
        mesh = np.meshgrid(*(np.array(widths[k]) for k in rest), np.arange(len(drop)), indexing="ij")
        cols = {k: g.ravel() for k, g in zip(rest, mesh[:-1], strict=True)}
        which = drop[mesh[-1].ravel()]
        n = len(which)
        yield cols | {
            "hidden_size": np.full(n, hidden),
            "mamba_num_heads": np.full(n, heads),
            "num_attention_heads": np.full(n, model.num_attention_heads),
            "mamba_layers": model.count("mamba") - which[:, 0],
            "moe_layers": model.count("moe") - which[:, 1],
            "attention_layers": np.full(n, model.count("attention")),
            "mlp_layers": np.full(n, model.count("mlp")),
        }


def search(
    model: HybridModel, scenario: Scenario, cost: HybridCost, plan: Mapping[str, Any], ranker: SingleChanges | None = None
) -> dict[str, Any]:
    """The `keep` feasible shapes with the most parameters (with `ranker`: the lowest proxy), widening ModelOpt's limits by 0.1
    until one is feasible."""
    base = cost.predict(model.base_shape(), whole_wave=True)
    base_costs = {k: float(v[0]) for k, v in base.items()}
    constraints = tuple(c.resolve(base_costs) for c in scenario.constraints)
    width, depth, keep = float(plan["max_width_pruning"]), float(plan["max_depth_pruning"]), int(plan["keep"])
    tried = "no limits"
    while True:
        widths, drops = axes(model, plan, width, depth)
        size = math.prod(len(v) for v in widths.values()) * len(drops)
        if size > int(plan["max_shapes"]):
            raise InfeasibleError(
                f"no shape of {model.name} meets {', '.join(c.describe() for c in constraints)} on {scenario.hardware.name} "
                f"at {tried}, and the grid at width {width:.1f} / depth {depth:.1f} holds {size:,} shapes "
                f"(more than plan.max_shapes={int(plan['max_shapes']):,}): loosen a bound, or raise plan.max_shapes"
            )
        tried = f"width {width:.1f} / depth {depth:.1f} pruning"
        best, feasible = [], 0
        if ranker is not None:  # first pass: which options feasible shapes take; the ranker measures those (and no others)
            taken: dict[str, set[int]] = {}
            for chunk in shapes(model, widths, drops):
                table = evaluate(cost, chunk, constraints)
                for key in ranker.keys:
                    taken.setdefault(key, set()).update(int(v) for v in table.loc[table["feasible"], key].unique())
            ranker.prepare(taken)
        for chunk in shapes(model, widths, drops):
            table = evaluate(cost, chunk, constraints)
            table = table[table["feasible"]]
            feasible += len(table)
            best.append(table.nlargest(keep, "params") if ranker is None else table.assign(proxy=ranker(table)).nsmallest(keep, "proxy"))
        if feasible or (width >= 0.9 and depth >= 0.9):
            break
        width, depth = min(width + 0.1, 0.9), min(depth + 0.1, 0.9)
    if not feasible:
        bounds = ", ".join(c.describe() for c in constraints)
        raise InfeasibleError(f"no shape of {model.name} meets {bounds} on {scenario.hardware.name} even at 90 % width and depth pruning")
    order = (["params", "tpot_ms"], [False, True]) if ranker is None else (["proxy", "params", "tpot_ms"], [True, False, True])
    top = pd.concat(best).sort_values(order[0], ascending=order[1]).head(keep)
    return {
        "base": base_costs,
        "constraints": constraints,
        "limits": {"max_width_pruning": round(width, 2), "max_depth_pruning": round(depth, 2)},
        "evaluated": size,
        "feasible_count": feasible,
        "feasible": top.reset_index(drop=True),
    }


SHOWN = [
    "params",
    "active_params",
    *(w for w in WIDTHS if w != "num_attention_heads"),  # query heads are not searched here
    "mamba_layers",
    "moe_layers",
    "memory_gib",
    "memory_headroom_gib",
    "ttft_ms",
    "tpot_ms",
    "throughput_tok_s",
]
LINES = [
    ("weights: embedding + LM head", "weights_embedding_gib"),
    ("weights: Mamba-2 blocks", "weights_mamba_gib"),
    ("weights: attention blocks", "weights_attention_gib"),
    ("weights: routed experts", "weights_moe_routed_gib"),
    ("weights: router, latent projections, shared expert", "weights_moe_other_gib"),
    ("weights: dense MLP blocks", "weights_mlp_gib"),
    ("KV cache (attention blocks)", "kv_cache_gib"),
    ("Mamba state (SSM + conv), all sequences", "mamba_state_gib"),
    ("activation workspace", "workspace_gib"),
    ("engine overhead", "overhead_gib"),
    ("total", "memory_gib"),
]


def memory_accounting(rows: Mapping[str, Mapping[str, float]]) -> str:
    """A Markdown table of the memory lines (GiB), one column per named row."""
    names = list(rows)
    out = ["| line (GiB) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key in LINES:
        out.append(f"| {label} | " + " | ".join(f"{float(rows[n][key]):.2f}" for n in names) + " |")
    return "\n".join(out)


def ranking(scored: Any = None, proxy: Mapping[str, Any] | None = None) -> str:
    """How the shapes were ordered, in one sentence (plan.md and metadata.json)."""
    if scored is None:
        return (
            "parameters kept, the order in which ModelOpt's Minitron takes candidates to its score function "
            "(uniform importance prior: no weights, every unit counts the same)."
        )
    first = (
        "the shapes with the most parameters"
        if proxy is None
        else f"the shapes with the lowest proxy (plan.rank=proxy: calibration-split KL of the anchor plus its single changes' deltas, "
        f"{proxy['rounds']} round(s), {proxy['measured']} measurements; blocks dropped by their own drop KL, not 1 - cosine)"
    )
    return (
        f"the first {len(scored.table)} of {first} scored by selection-split KL to the unpruned model (ModelOpt's score_func; "
        f"units ranked by activation importance on calibration text); the best first (report-split KL {scored.kl_report:.4f}, "
        f"perplexity {scored.perplexity_report:.1f}), sliced into pruned/; the rest in that order."
    )


def report(
    model: HybridModel, scenario: Scenario, result: Mapping[str, Any], plan: Mapping[str, Any], terms: str, scored: Any = None
) -> str:
    """plan.md: what was asked, what fits, and the memory line by line."""
    hw, wl = scenario.hardware, scenario.workload
    feasible: pd.DataFrame = result["feasible"]
    top = feasible.head(int(plan["show"]))[SHOWN + (["proxy"] if "proxy" in feasible else [])].copy()
    for k in ("params", "active_params"):
        top[k] = (top[k] / 1e9).round(2)
    top = top.rename(columns={"params": "params (B)", "active_params": "active (B)"}).round(2)
    base = {"memory_gib": result["base"]["memory_gib"]} | {key: result["base"][key] for _, key in LINES}
    device = hw.memory_utilization * hw.memory_gib
    lines = [
        f"# Plan: {model.name} on {hw.name}, {wl.name}",
        "",
        f"Workload: {wl.concurrency} x ({wl.prompt_len} in, {wl.output_len} out), context {wl.context_len}, {wl.dtype}. "
        f"Device memory for the engine: {hw.memory_utilization:g} x {hw.memory_gib:g} GiB = {device:.1f} GiB.",
        f"Constraints: {'; '.join(c.describe() for c in result['constraints'])}; and the device holds it (whole wave, KV for the context).",
        f"Base model: {result['base']['params'] / 1e9:.2f} B parameters ({result['base']['active_params'] / 1e9:.2f} B active), "
        f"{result['base']['memory_gib']:.1f} GiB, TTFT {result['base']['ttft_ms']:.0f} ms, "
        f"TPOT {result['base']['tpot_ms']:.2f} ms (whole wave).",
        f"Grid: {result['evaluated']} shapes at width <= {result['limits']['max_width_pruning']:g}, depth <= "
        f"{result['limits']['max_depth_pruning']:g}; {result['feasible_count']} feasible, the first {len(feasible)} kept.",
        f"Cost model: hybrid roofline, {terms}; not fitted to a hybrid model in an engine.",
        f"Ranking: {ranking(scored, result.get('proxy'))}",
        "",
        markdown(top),
        "",
        "## Memory, line by line",
        "",
        memory_accounting({"base": base, "first shape": feasible.iloc[0].to_dict()}),
        "",
    ]
    return "\n".join(lines)


def run_plan(
    model: HybridModel,
    scenario: Scenario,
    plan: Mapping[str, Any],
    choice: str,
    results_dir: str,
    run_id: str | None,
    weights: str | None = None,
    data: DataSpec | None = None,
    overwrite: bool = False,
) -> Path:
    """The plan; with `weights` (a Nemotron-H checkpoint folder) its top_k shapes are also scored on `data` and the best sliced."""
    for key in ("max_width_pruning", "max_depth_pruning"):
        value = plan.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ConfigError(f"plan.{key}={value!r} must be a number in [0, 1)")
    for key in (*DIVISORS, "keep", "show", "max_shapes", "top_k", "rounds"):
        value = plan.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"plan.{key}={value!r} must be a whole number >= 1")
    rank = plan.get("rank", "params")
    if rank not in RANKS:
        raise ConfigError(f"plan.rank={rank!r} is unknown; use {' or '.join(RANKS)}")
    if rank == "proxy" and weights is None:
        raise ConfigError(
            "plan.rank=proxy measures single changes with the model's weights: add plan.weights=true architecture.path=CHECKPOINT"
        )
    out = Path(results_dir).resolve() / scenario.name / f"plan-{run_id or dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    check_output(out, overwrite, key="results.run_id", marker="plan.parquet", what="a plan")
    start = time.time()
    hw, terms = hardware_terms(scenario.hardware, choice)
    cost = HybridCost(model, hw, scenario.workload)
    data = data or DataSpec()
    scored = None
    result = search(model, scenario, cost, plan)  # by parameters; a bound nothing meets is refused here, before any weights load
    if weights is not None:
        from autocompress.arch.nemotron_h_pruning import hybrid_of
        from autocompress.baselines import minitron_nemotron_h as mnh

        net, tokenizer = mnh.load(weights)
        tokens, imp = mnh.calibrate(net, tokenizer, data)
        if rank == "proxy":
            from autocompress.search.nemotron_h import SingleChanges

            ranker = SingleChanges(net, hybrid_of(net), imp, tokens.calib)
            imp = ranker.imp
            grid = dict(plan) | result["limits"]  # the limits at which shapes fit: every round ranks that grid
            rounds = 0
            while rounds < int(plan["rounds"]):
                if rounds:  # re-anchor the deltas at the best feasible shape, unless that is the anchor already
                    best = {k: int(result["feasible"].iloc[0][k]) for k in ranker.anchor}
                    if best == ranker.anchor:
                        break
                    ranker.anchor_at(best)
                result = search(model, scenario, cost, grid, ranker)
                rounds += 1
            result["proxy"] = {
                "rounds": rounds,
                "rounds_asked": int(plan["rounds"]),
                "measured": ranker.measured,
                "anchor": ranker.anchor,
                "anchor_kl": ranker.anchor_kl,
            }
            ranker.release()
    feasible: pd.DataFrame = result["feasible"]
    if weights is not None:
        scored = mnh.score(net, feasible, int(plan["top_k"]), tokens, imp)
        feasible = pd.concat([scored.table[scored.table["chosen"]].drop(columns=["kl_select", "perplexity_select", "chosen"]), feasible])
        feasible = feasible.drop_duplicates(subset=[c for c in SHAPE_KEYS if c in feasible.columns])
        result["feasible"] = feasible.reset_index(drop=True)
    text = report(model, scenario, result, plan, terms, scored)
    first = feasible.iloc[0].to_dict()
    first_shape = {k: first[k] for k in SHAPE_KEYS}
    meta = {
        "scenario": scenario.name,
        "model": model.name,
        "model_source": model.source,
        "cost_model": f"hybrid roofline: {terms}",
        "ranking": ranking(scored, result.get("proxy")),
        "rank": rank,
        "proxy": result.get("proxy"),
        "constraints": {c.metric: {"value": c.value, "sense": c.sense} for c in result["constraints"]},
        "limits": result["limits"],
        "evaluated": result["evaluated"],
        "feasible": result["feasible_count"],
        "base": result["base"],
        "first": {k: (v.item() if isinstance(v, np.generic) else v) for k, v in first.items()},
        "first_config": shape_config(model, first_shape),
        "seconds": time.time() - start,
        "code": git_sha(),
    }
    with staged(out, overwrite, key="results.run_id", marker="plan.parquet", what="a plan") as tmp:  # whole or not at all
        tmp.mkdir(parents=True)
        write_parquet(feasible.head(int(plan["keep"])), tmp / "plan.parquet")
        write_config(model, first_shape, tmp / "first_shape")
        write_text(text, tmp / "plan.md")
        if scored is not None:
            how = "Minitron's ranking" if rank == "params" else "AutoCompress's single-change ranking"
            card = f"# {model.name} pruned for `{scenario.name}` (plan.weights: the planner's grid, {how}, scored on text)"
            card += f"\n\nShape: {first_shape}"
            meta["pruned"] = {
                "shape": scored.best,
                "kl_report": scored.kl_report,
                "perplexity_report": scored.perplexity_report,
                "max_abs_logit_diff": mnh.write(net, tokenizer, scored, tmp / "pruned", card),
                "data": asdict(data),
            }
            write_parquet(scored.table, tmp / "scored.parquet")
        write_json(meta, tmp / "metadata.json")
    print(text)
    log(f"{result['feasible_count']} of {result['evaluated']} shapes feasible; plan in {out}")
    return out


def load_architecture(data: Mapping[str, Any]) -> HybridModel:
    """The `architecture` section: its own fields, or those of the config.json at architecture.path."""
    if data.get("path"):
        return HybridModel.from_file(str(data["path"]))
    return HybridModel.from_mapping({k: v for k, v in data.items() if k != "path"})


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
@hydra_task("nothing was written")
def main(cfg: DictConfig) -> None:
    data = plain(cfg)
    results_dir, run_id = results_of(data)  # checked before anything is read
    architecture = data.get("architecture") or {}
    weights = data["plan"].get("weights")
    if not isinstance(weights, bool):
        raise ConfigError(f"plan.weights={weights!r} must be true or false")
    if weights and not architecture.get("path"):
        raise ConfigError("plan.weights=true scores shapes with the model's weights: give architecture.path=CHECKPOINT_FOLDER")
    run_plan(
        load_architecture(architecture),
        scenario_from_dict(data),
        data["plan"],
        str(data.get("cost_model") or "auto"),
        results_dir,
        run_id,
        weights=str(architecture["path"]) if weights else None,
        data=build(DataSpec, data.get("data") or {}, "data"),
        overwrite=overwrite_flag(data),
    )


if __name__ == "__main__":
    hydra_entry(main)
