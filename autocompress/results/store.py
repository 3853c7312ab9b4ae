"""Result files of a sweep: one row per trial in trials.parquet, the fronts in pareto.parquet.

Files are written to a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from autocompress.arch.space import Architecture
from autocompress.config.families import LLAMA
from autocompress.config.metrics import Constraint
from autocompress.config.schema import RunSpec
from autocompress.cost import COST_KEYS
from autocompress.io import RUN_PARETO, RUN_TRIALS, RunPaths
from autocompress.results.runcheck import FRONT_COLUMNS, RunFolderError, check_metadata, check_run_folder, check_table, read_table

# column -> (dtype, meaning); docs/commands.md ("Results schema") documents the same schema
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
    "num_attention_heads": ("int64", "global query-head count"),
    "num_attention_kept": ("int64", "layers whose attention is kept"),
    "num_ffn_kept": ("int64", "layers whose FFN is kept"),
    "mean_kv_heads": ("float64", "KV heads per layer, averaged over all layers (no-op = 0)"),
    "mean_ffn": ("float64", "FFN intermediate size averaged over all layers (no-op = 0)"),
    "heterogeneous": ("bool", "layers differ in shape"),
    "params": ("int64", "parameter count"),
    "family": ("string", "llama (dense: the gradient search) | granitemoehybrid (hybrid Mamba-2 / attention / MoE: search.moe)"),
    "active_params": ("int64", "parameters one token uses (MoE: the top-k routed experts only; dense: = params)"),
    "experts": ("int64", "routed experts kept per MoE layer (-1 for dense models)"),
    "expert_ffn": ("int64", "each routed expert's FFN width (-1 for dense models)"),
    "shared_ffn": ("int64", "the shared expert's FFN width (-1 for dense models)"),
    "mamba_layers": ("int64", "Mamba-2 layers kept (-1 for dense models)"),
    "attention_layers": ("int64", "attention layers kept (-1 for dense models; see num_attention_kept)"),
    "layers_kept": ("string", "JSON list of the base model's layers kept (hybrid MoE models; empty for dense)"),
    "ttft_ms": ("float64", "predicted time to first token of the workload's wave, ms"),
    "tpot_ms": ("float64", "predicted time per output token, ms"),
    "throughput_tok_s": ("float64", "predicted output throughput, tokens/s"),
    "memory_gib": ("float64", "predicted serving memory, GiB"),
    "feasible_ttft_ms": ("boolean", "meets the TTFT constraint (missing if unconstrained)"),
    "feasible_tpot_ms": ("boolean", "meets the TPOT constraint (missing if unconstrained)"),
    "feasible_throughput_tok_s": ("boolean", "meets the throughput constraint (missing if unconstrained)"),
    "feasible_memory_gib": ("boolean", "meets the memory constraint (missing if unconstrained)"),
    "feasible": ("bool", "meets every constraint under the cost model that judged it"),
    "kl_select": ("float64", "selection-split KL(teacher || pruned), nats/token, no retraining: what the Pareto front and Optuna use"),
    "perplexity_select": ("float64", "selection-split perplexity of the pruned model, no retraining"),
    "kl": ("float64", "report-split KL(teacher || pruned), nats/token, no retraining: the number to report"),
    "perplexity": ("float64", "report-split perplexity of the pruned model, no retraining"),
    "repair_steps": ("int64", "single-decision downgrades applied after the search to meet the constraints"),
    "fill_steps": ("int64", "single-decision upgrades applied after repair into the slack inside the margin-tightened bounds"),
    "origin": (
        "string",
        "search | homogeneous: the search's own result or the filled homogeneous rival, the lower selection KL",
    ),
    "searched_kl_select": ("float64", "selection-split KL of the search's own result, kept or not (= kl_select where origin is search)"),
    "searched_params": ("int64", "parameter count of the search's own result, kept or not"),
    "wall_s": ("float64", "wall-clock seconds of the search"),
    "steps_s": ("float64", "of wall_s: the gradient (and settling) steps"),
    "repair_s": ("float64", "of wall_s: the repair moves (each candidate scored on search.probe_sequences windows)"),
    "fill_s": ("float64", "of wall_s: the fill moves"),
    "rival_s": ("float64", "of wall_s: the homogeneous rival's repair, fill and selection score"),
    "score_s": ("float64", "of wall_s: the pick's selection- and report-split evaluation"),
    "cost_model": ("string", "id of the cost model that predicted the costs"),
    "cost_model_extrapolated": ("bool", "the architecture or workload lies outside what the (fitted) cost model was measured on"),
}


def architecture_columns(arch: Architecture) -> dict[str, Any]:
    """Flat summary columns of an architecture."""
    n = arch.num_layers
    return {
        "architecture": arch.to_json(),
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_attention_kept": sum(b.kv_heads > 0 for b in arch.blocks),
        "num_ffn_kept": sum(b.ffn > 0 for b in arch.blocks),
        "mean_kv_heads": sum(b.kv_heads for b in arch.blocks) / n,
        "mean_ffn": sum(b.ffn for b in arch.blocks) / n,
        "heterogeneous": not arch.is_homogeneous(),
        "params": arch.num_params(),
        "family": LLAMA,
        "active_params": arch.num_params(),
        "layers_kept": "",
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


def load(run_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(trials, pareto) DataFrames of one sweep run folder, with the documented dtypes (see `load_run` for all of it)."""
    return load_trials(run_dir), load_pareto(run_dir)


# --------------------------------------------------------------------------- typed readers of a finished run


@dataclass(frozen=True)
class Run(RunPaths):
    """One finished sweep run (its files' paths from RunPaths): its trials, Pareto points, metadata.json and (when it still
    parses) its RunSpec."""

    trials: pd.DataFrame
    pareto: pd.DataFrame
    metadata: dict[str, Any]
    spec: RunSpec | None

    @property
    def scenario(self) -> str:
        return str(self.metadata.get("scenario") or self.path.parent.name)

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def label(self) -> str:
        """`scenario/run_id`, how reports name the run."""
        return f"{self.scenario}/{self.run_id}"

    @property
    def base_costs(self) -> dict[str, float]:
        """The unpruned model's predicted costs."""
        return {k: float(v) for k, v in (self.metadata.get("base_costs") or {}).items()}

    @property
    def constraints(self) -> dict[str, Constraint]:
        """metric -> absolute bound, as the sweep resolved it."""
        raw = self.metadata.get("constraints") or {}
        return {m: Constraint(m, float(b["value"])) for m, b in raw.items()}


def selection_quality(df: pd.DataFrame) -> str:
    """The column that picks among trials: `kl_select` (selection split), or `kl` for runs recorded before it existed."""
    return "kl_select" if "kl_select" in df.columns and df["kl_select"].notna().any() else "kl"


def typed(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with the documented dtypes on the schema's columns (front_* as bool); other columns untouched."""
    out = df.copy()
    for col, (dtype, _) in TRIAL_SCHEMA.items():
        if col in out.columns and str(out[col].dtype) != dtype:
            out[col] = out[col].astype(dtype)
    for col in FRONT_COLUMNS:
        if col in out.columns:
            out[col] = out[col].fillna(False).astype(bool)
    return out


def load_metadata(run_dir: str | Path) -> dict[str, Any]:
    """metadata.json of a finished run; RunFolderError naming the problem and the fix otherwise."""
    run = Path(run_dir)
    if not run.is_dir():
        raise RunFolderError(f"{run} is not a folder; give a sweep run folder (results/<scenario>/<run_id>)")
    return check_metadata(run)


VERIFIED = ("measured.parquet", "estimated.parquet")  # what `verify` writes under <run>/verify/, one row per trial id


def with_verified(run: Path, df: pd.DataFrame, verify_dir: Path | None = None) -> pd.DataFrame:
    """`df` (a run's trials or front) with the columns `verify` wrote for its trial ids under `verify_dir` (default
    <run>/verify/); unchanged where nothing was verified."""
    folder = Path(verify_dir) if verify_dir is not None else RunPaths(run).verify_dir
    for name in VERIFIED:
        if not (folder / name).exists() or "trial_id" not in df:
            continue
        extra = read_table(folder / name)
        cols = [c for c in extra.columns if c != "trial_id"]
        df = df.drop(columns=[c for c in cols if c in df.columns]).merge(extra, on="trial_id", how="left")
    return df


def _read_parquet(run: Path, name: str) -> pd.DataFrame:
    return typed(with_verified(run, check_table(run / name, front=name == RUN_PARETO)))


def load_trials(run_dir: str | Path) -> pd.DataFrame:
    """trials.parquet with the documented dtypes (one row per trial)."""
    return _read_parquet(Path(run_dir), RUN_TRIALS)


def load_pareto(run_dir: str | Path) -> pd.DataFrame:
    """pareto.parquet with the documented dtypes (the trial columns plus front_*)."""
    return _read_parquet(Path(run_dir), RUN_PARETO)


def load_run(run_dir: str | Path) -> Run:
    """Everything a finished run folder holds, checked (`check_run_folder`): RunFolderError if it is not a finished run."""
    run = Path(run_dir).resolve()
    checked = check_run_folder(run, config="optional")  # an older config.yaml: metadata.json still holds what a report needs
    trials, pareto = (typed(with_verified(run, checked.tables[name])) for name in (RUN_TRIALS, RUN_PARETO))
    return Run(path=run, trials=trials, pareto=pareto, metadata=checked.metadata, spec=checked.spec)


def layers(df: pd.DataFrame) -> pd.DataFrame:
    """Per-layer long form of the `architecture` column: one row per (trial, layer).

    Columns: trial_id, layer, hidden_size, kv_heads (0 = no-op attention), ffn (0 = no-op FFN),
    attention_kept, ffn_kept.
    """
    rows = []
    for trial_id, text in zip(df["trial_id"], df["architecture"], strict=True):
        if pd.isna(text) or not text:
            continue  # a failed trial has no architecture
        arch = Architecture.from_json(str(text))
        for i, b in enumerate(arch.blocks):
            rows.append((trial_id, i, arch.hidden_size, b.kv_heads, b.ffn, b.kv_heads > 0, b.ffn > 0))
    columns = ["trial_id", "layer", "hidden_size", "kv_heads", "ffn", "attention_kept", "ffn_kept"]
    dtypes = ["string", "int64", "int64", "int64", "int64", "bool", "bool"]
    out = pd.DataFrame(rows, columns=columns)
    return out.astype(dict(zip(columns, dtypes, strict=True)))
