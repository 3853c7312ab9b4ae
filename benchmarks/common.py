"""What the benchmarks share (a module, not a benchmark: nothing here runs on its own). A benchmark run as
`python benchmarks/NAME.py` finds it beside itself, and importing it checks that the `autocompress` imported is this
tree's: a benchmark run from a `git worktree` at a recorded commit must measure that commit's code, not the package
installed from another checkout (set PYTHONPATH=<the worktree>)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import autocompress
from autocompress.arch.masking import MaskedModel
from autocompress.arch.space import Architecture
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
