"""Does the search beat naive choices at equal predicted cost? And do scenarios give different shapes?

For each scenario: run the search with a few Lagrangian settings, build the uniform-fraction
architecture (every dimension pruned by the same fraction, the largest that is feasible) and 20
random feasible architectures grown to the constraint boundary; measure held-out KL (no
retraining) of all of them on the same tokens. Writes JSON and prints Markdown tables.

    .venv/bin/python benchmarks/search_quality.py --scenario h100_batched --scenario rtx5070_coding
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from autocompress.arch import Architecture
from autocompress.baselines import random_feasible, uniform_architecture
from autocompress.compose import compose_spec
from autocompress.config import LagrangianSettings
from autocompress.masking import MaskedModel
from autocompress.prepare import prepare
from autocompress.search import evaluate, run_search

SETTINGS = [
    LagrangianSettings(margin=0.0, dual_lr=2.0),
    LagrangianSettings(margin=0.1, dual_lr=0.5),
    LagrangianSettings(margin=0.0, dual_lr=0.5, seed=1),
]


def shape(arch: Architecture) -> dict[str, Any]:
    """Per-layer shape strings: attention 'KV heads' or '-', FFN width in units of 128 or '-'."""
    return {
        "hidden": arch.hidden_size,
        "attention": "".join(str(b.kv_heads) if b.kv_heads else "-" for b in arch.blocks),
        "ffn": [b.ffn for b in arch.blocks],
    }


def bench_scenario(name: str, n_settings: int, n_random: int, overrides: list[str]) -> dict[str, Any]:
    spec = compose_spec(f"+scenario={name}", *overrides)
    prep = prepare(spec, progress=False)
    model, inputs, cm = prep.base.model, prep.inputs, prep.cost_model
    masked = MaskedModel(model, prep.space, inputs.ranking)

    def held_out(arch: Architecture) -> dict[str, Any]:  # the report split: documents neither the search nor a selection saw
        kl, ppl = evaluate(model, masked, arch, inputs.report, inputs.teacher_report)
        return {"kl": kl, "perplexity": ppl, "params": arch.num_params(), **cm.predict(arch), **shape(arch)}

    out: dict[str, Any] = {
        "scenario": name,
        "constraints": {c.metric: c.value for c in inputs.constraints},
        "base": held_out(prep.space.largest()),
    }
    out["searched"] = []
    for settings in SETTINGS[:n_settings]:
        start = time.time()
        res = run_search(model, inputs, cm, spec.search, settings)
        row = held_out(res.architecture) | {
            "settings": dataclasses.asdict(settings),
            "feasible": res.all_feasible,
            "search_s": time.time() - start,
        }
        out["searched"].append(row)
        print(
            f"{name}: searched {settings.margin=} {settings.dual_lr=} {settings.seed=}: kl={row['kl']:.3f} ({row['search_s']:.0f}s)",
            flush=True,
        )
    uniform = uniform_architecture(prep.space, cm, inputs.constraints)
    out["uniform"] = None if uniform is None else held_out(uniform)
    rng = random.Random(0)
    out["random"] = []
    for _ in range(n_random):
        arch = random_feasible(prep.space, cm, inputs.constraints, rng)
        if arch is not None:
            out["random"].append(held_out(arch))
    masked.remove()
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | searched KL (each setting) | best searched | uniform-fraction KL | random feasible KL (median of n) | base PPL |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        kls = [s["kl"] for s in r["searched"]]
        uni = "n/a" if r["uniform"] is None else f"{r['uniform']['kl']:.3f}"
        rnd = [x["kl"] for x in r["random"]]
        med = f"{statistics.median(rnd):.3f} (n={len(rnd)})" if rnd else "not run"
        lines.append(
            f"| {r['scenario']} | {', '.join(f'{k:.3f}' for k in kls)} | {min(kls):.3f} | {uni} | {med} | {r['base']['perplexity']:.2f} |"
        )
    lines += ["", "Per-layer shapes of the best searched architecture (attention: KV heads per layer, '-' = no-op; FFN width / 128):", ""]
    for r in results:
        best = min(r["searched"], key=lambda s: s["kl"])
        ffn = " ".join("-" if f == 0 else f"{f // 128}" for f in best["ffn"])
        lines.append(f"- **{r['scenario']}** hidden {best['hidden']}, params {best['params'] / 1e6:.1f}M")
        lines.append(f"  - attention `{best['attention']}`\n  - FFN `{ffn}`")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", required=True)
    parser.add_argument("--settings", type=int, default=len(SETTINGS), help="how many of the Lagrangian settings to search with")
    parser.add_argument("--random", type=int, default=20, help="random feasible architectures per scenario")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/search_quality.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. search.steps=24")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for name in args.scenario:
        results.append(bench_scenario(name, args.settings, args.random, args.overrides))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    print(markdown(results))


if __name__ == "__main__":
    main()
