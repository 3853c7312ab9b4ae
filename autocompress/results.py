"""Result files of a sweep: one row per trial in trials.parquet, the fronts in pareto.parquet.

Files are written to a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from autocompress.arch import Architecture
from autocompress.config import Constraint
from autocompress.cost import COST_KEYS

# column -> (dtype, meaning); the README documents the same schema
TRIAL_SCHEMA: dict[str, tuple[str, str]] = {
    "trial_id": ("string", "Ray Tune trial id"),
    "status": ("string", "ok | error"),
    "error": ("string", "error message of a failed trial (empty when ok)"),
    "lambda_init": ("float64", "Lagrangian setting: initial multiplier"),
    "dual_lr": ("float64", "Lagrangian setting: dual-ascent step (0 = fixed weights)"),
    "margin": ("float64", "Lagrangian setting: share by which every bound was tightened"),
    "quadratic": ("float64", "Lagrangian setting: quadratic penalty weight"),
    "tau_start": ("float64", "Gumbel-softmax temperature at the first step"),
    "tau_end": ("float64", "Gumbel-softmax temperature at the last step"),
    "lr": ("float64", "Adam step on the architecture logits"),
    "seed": ("int64", "search seed"),
    "architecture": ("string", "architecture as JSON (hidden_size, block_configs in nemotron-nas form)"),
    "hidden_size": ("int64", "global hidden size"),
    "num_attention_kept": ("int64", "layers whose attention is kept"),
    "num_ffn_kept": ("int64", "layers whose FFN is kept"),
    "mean_kv_heads": ("float64", "KV heads per layer, averaged over all layers (no-op = 0)"),
    "mean_ffn": ("float64", "FFN intermediate size averaged over all layers (no-op = 0)"),
    "heterogeneous": ("bool", "layers differ in shape"),
    "params": ("int64", "parameter count"),
    "ttft_ms": ("float64", "predicted time to first token of the workload's wave, ms"),
    "tpot_ms": ("float64", "predicted time per output token, ms"),
    "throughput_tok_s": ("float64", "predicted output throughput, tokens/s"),
    "memory_gib": ("float64", "predicted serving memory, GiB"),
    "feasible_ttft_ms": ("boolean", "meets the TTFT constraint (missing if unconstrained)"),
    "feasible_tpot_ms": ("boolean", "meets the TPOT constraint (missing if unconstrained)"),
    "feasible_throughput_tok_s": ("boolean", "meets the throughput constraint (missing if unconstrained)"),
    "feasible_memory_gib": ("boolean", "meets the memory constraint (missing if unconstrained)"),
    "feasible": ("bool", "meets every constraint under the cost model that judged it"),
    "kl": ("float64", "held-out KL(teacher || pruned), nats/token, no retraining"),
    "perplexity": ("float64", "held-out perplexity of the pruned model, no retraining"),
    "repair_steps": ("int64", "single-decision downgrades applied after the search to meet the constraints"),
    "wall_s": ("float64", "wall-clock seconds of the search"),
    "cost_model": ("string", "id of the cost model that predicted the costs"),
}
FRONT_COLUMNS = [f"front_{c}" for c in (*COST_KEYS, "all")]


def architecture_columns(arch: Architecture) -> dict[str, Any]:
    """Flat summary columns of an architecture."""
    n = arch.num_layers
    return {
        "architecture": arch.to_json(),
        "hidden_size": arch.hidden_size,
        "num_attention_kept": sum(b.kv_heads > 0 for b in arch.blocks),
        "num_ffn_kept": sum(b.ffn > 0 for b in arch.blocks),
        "mean_kv_heads": sum(b.kv_heads for b in arch.blocks) / n,
        "mean_ffn": sum(b.ffn for b in arch.blocks) / n,
        "heterogeneous": not arch.is_homogeneous(),
        "params": arch.num_params(),
    }


def feasibility_columns(constraints: tuple[Constraint, ...], feasible: Mapping[str, bool]) -> dict[str, Any]:
    cols: dict[str, Any] = {f"feasible_{k}": None for k in COST_KEYS}
    cols.update({f"feasible_{c.metric}": bool(feasible[c.metric]) for c in constraints})
    cols["feasible"] = all(feasible[c.metric] for c in constraints)
    return cols


def trials_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows -> DataFrame with exactly the documented columns and dtypes."""
    df = pd.DataFrame(rows, columns=list(TRIAL_SCHEMA))
    for col, (dtype, _) in TRIAL_SCHEMA.items():
        if dtype == "bool":
            df[col] = df[col].fillna(False).astype(bool)
        elif dtype == "int64":
            df[col] = pd.to_numeric(df[col]).fillna(-1).astype("int64")
        else:
            df[col] = df[col].astype(dtype)
    return df


def write_parquet(df: pd.DataFrame, path: Path) -> Path:
    """Write `df` to `path` atomically (temp file in the same folder, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, path)
    return path


def write_text(text: str, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json(data: Mapping[str, Any], path: Path) -> Path:
    return write_text(json.dumps(data, indent=2, default=str) + "\n", path)


def load(run_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(trials, pareto) DataFrames of one sweep run folder."""
    run = Path(run_dir)
    for name in ("trials.parquet", "pareto.parquet"):
        if not (run / name).exists():
            raise FileNotFoundError(f"{run / name} does not exist; is {run} a finished sweep run?")
    return pd.read_parquet(run / "trials.parquet"), pd.read_parquet(run / "pareto.parquet")
