"""Exporting a hybrid-MoE trial (GraniteMoeHybrid): the pruned checkpoint that transformers and vLLM load as it is.

The trial's importance is not stored (for a large MoE it is every expert's channel order); the export
ranks again on the same calibration windows (the trial seed's half, autocompress.search.moe) and checks
that the result is the trial's model: its selection-split KL must equal the one the trial recorded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from autocompress.arch.moe_pruning import MoEShape, moe_importance, prune
from autocompress.checkpoints.pipeline import ExportRequest
from autocompress.checkpoints.verification import ExportError, vllm_greedy
from autocompress.config.schema import RunSpec
from autocompress.io import staged
from autocompress.model.data import load_token_data
from autocompress.results.runcheck import CheckedRun
from autocompress.search.moe import calibration_half, kl_and_perplexity, load_moe, logits_of, model_path


def shape_of(row: dict[str, Any]) -> MoEShape:
    return MoEShape.from_json(row["architecture"])


def export_trial(req: ExportRequest, row: dict[str, Any], run: CheckedRun) -> dict[str, Any]:
    """The hybrid-MoE family's export stage (config/families.py): `req` an ExportRequest, `run` the checked run folder."""
    assert run.spec is not None  # export checks the run folder with its config required
    return export_moe(row, run.spec, req.out, req.overwrite, req.verify, req.vllm)


def export_moe(row: dict[str, Any], spec: RunSpec, out: Path, overwrite: bool, verify: bool, vllm: bool) -> dict[str, Any]:
    """Write the trial's pruned model to `out`; returns what was checked."""
    model, tokenizer = load_moe(model_path(spec, progress=False))
    data = load_token_data(spec.data, tokenizer)
    imp = moe_importance(model, calibration_half(data.calib, int(row["seed"])))
    pruned = prune(model, shape_of(row), imp)
    report: dict[str, Any] = {"trial_id": row["trial_id"], "params": sum(p.numel() for p in pruned.parameters()), "out": out}
    with staged(out, overwrite) as tmp:
        pruned.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if verify:
            kl, _ = kl_and_perplexity(pruned, data.select, logits_of(model, data.select))
            report["kl_select"], report["trial_kl_select"] = kl, float(row["kl_select"])
            if not math.isclose(kl, float(row["kl_select"]), rel_tol=1e-4, abs_tol=1e-6):
                raise ExportError(
                    f"the export's selection KL {kl:.6f} is not the trial's {float(row['kl_select']):.6f}: the importance ranking "
                    "came out different (another model checkpoint or calibration text than the run's?)"
                )
            ids = data.report[:2, :16]
            greedy = greedy_uncached(reload_checked(pruned, tmp, ids), ids, 8)
            report["greedy"] = greedy.tolist()
            if vllm:
                served = vllm_greedy(tmp, ids.tolist(), 8)
                report["vllm_greedy_match"] = served == greedy.tolist()
                if not report["vllm_greedy_match"]:
                    raise ExportError(f"vLLM's greedy tokens {served} differ from transformers' {greedy.tolist()}")
        record = {"trial": {k: _plain(v) for k, v in row.items()}, "checks": {k: _plain(v) for k, v in report.items()}}
        (tmp / "autocompress.json").write_text(json.dumps(record, indent=1) + "\n")
    return report


@torch.no_grad()
def reload_checked(pruned: Any, folder: Path, ids: torch.Tensor) -> Any:
    """The checkpoint `pruned` was saved to in `folder`, loaded back; ExportError unless its logits on `ids` equal `pruned`'s.

    The loaded tensors are copied into fresh storage first: safetensors maps them from the file at offsets that need not
    be 64-byte aligned, and on some CPUs (an AVX-512 BF16 EPYC here) the GEMM kernels round differently for misaligned
    operands (logits 2.9e-6 apart from the same weights; the aligned copies equal the pruned model's bit for bit). The
    check is about the file's contents, so it compares them in the same memory layout, exactly.
    """
    reloaded = type(pruned).from_pretrained(folder, dtype=torch.float32).eval()
    for t in [*reloaded.parameters(), *reloaded.buffers()]:
        t.data = t.data.clone()
    if not torch.equal(reloaded(ids, use_cache=False).logits, pruned(ids, use_cache=False).logits):
        raise ExportError(f"the checkpoint written to {folder} does not load back to the pruned model's logits")
    return reloaded


@torch.no_grad()
def greedy_uncached(model: Any, ids: torch.Tensor, n: int) -> torch.Tensor:
    """`n` greedy tokens after `ids` [b, s], each from a full forward pass without a cache.

    transformers' `generate` refuses a GraniteMoeHybrid of Mamba layers only (its hybrid cache wants an attention
    layer); a model this small decodes 8 tokens uncached in well under a second.
    """
    out = ids
    for _ in range(n):
        out = torch.cat([out, model(out, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[:, ids.shape[1] :]


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    return None if isinstance(v, float) and math.isnan(v) else v if isinstance(v, str | int | float | bool | type(None)) else str(v)
