"""AutoCompress's ranking against Minitron's on a Nemotron-H with weights, at several bounds (plan.rank=proxy vs params).

    .venv/bin/python benchmarks/nemotron_h_search.py                      # cpu_interactive, TPOT and TTFT at 0.95x .. 0.8x
    .venv/bin/python benchmarks/nemotron_h_search.py --factors 0.9 --rounds 1 2

For each bound (TPOT and TTFT both at FACTOR x the unpruned model's, the analytic roofline of the scenario's
hardware), `python -m autocompress.plan ... plan.weights=true` runs on the tiny trained Nemotron-H
(autocompress.model.tiny_moe.TinyNemotronH, cached) once with Minitron's ranking (plan.rank=params: the
feasible shapes with the most parameters) and once per --rounds value with AutoCompress's (plan.rank=proxy:
single-change calibration KLs around an anchor). Both measure plan.top_k (10) shapes on the selection split and
keep the lowest; the report split scores the pick. With --equal-budget (on) Minitron runs once more with top_k = the
proxy's measurements of calibration and selection text together, so it sees as many shapes as the proxy measured.
The grid and its limits are the same for all (ModelOpt's, widened until a shape fits).
Writes benchmarks/results/nemotron_h_search/<scenario>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common  # checks that the autocompress imported is this tree's

ROOT = Path(__file__).resolve().parent.parent

C4 = ROOT.parent / "shared" / "data" / "corpora" / "c4_sample"
KEYS = ("hidden_size", "mamba_num_heads", "mamba_head_dim", "intermediate_size", "mamba_layers")


def shared(scored: Any, minitron: Any) -> dict[str, Any]:
    """The shapes both rankings measured, and the largest difference of their selection KLs: 0 where both cut the same units
    (everything but which blocks a depth cut drops is common to both; proxy drops by drop KL, params by 1 - cosine)."""
    both = scored.merge(minitron, on=list(KEYS), suffixes=("", "_params"))
    gap = (both["kl_select"] - both["kl_select_params"]).abs().max() if len(both) else None
    return {"shapes": len(both), "max_kl_select_difference": None if gap is None else float(gap)}


def main() -> None:
    import pandas as pd

    from autocompress.config.schema import DataSpec
    from autocompress.model.tiny_moe import TinyNemotronH, tiny_hybrid_moe

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="cpu_interactive")
    parser.add_argument("--factors", type=float, nargs="+", default=[0.95, 0.9, 0.85, 0.8])
    parser.add_argument("--rounds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--results-dir", default="results")
    parser.add_argument(
        "--equal-budget", action=argparse.BooleanOptionalAction, default=True, help="also Minitron with top_k = the proxy's measurements"
    )
    parser.add_argument("--reuse", action="store_true", help="keep plan folders a previous run of this script left (summarise them again)")
    args = parser.parse_args()
    run_record = common.Record()
    if not C4.is_dir():
        raise SystemExit(f"the C4 sample is not at {C4} (see ../shared/data/PROVENANCE.md)")
    trained = tiny_hybrid_moe(DataSpec(source="jsonl", path=str(C4)), TinyNemotronH())
    results = Path(args.results_dir).resolve()
    divisors = ["plan.hidden_size_divisor=16", "plan.ffn_hidden_size_divisor=32", "plan.mamba_head_dim_divisor=4"]
    rows = []

    def arm(factor: float, rank: str, rounds: int, top_k: int = 10) -> dict[str, Any]:
        name = f"{rank}{rounds}" if rank == "proxy" else ("params" if top_k == 10 else f"params-top{top_k}")
        run_id = f"search-{trained.path.name}-{factor}-{name}"
        out = results / args.scenario / f"plan-{run_id}"
        reused = args.reuse and (out / "metadata.json").is_file()
        if not reused:
            shutil.rmtree(out, ignore_errors=True)
        command = [
            f"+scenario={args.scenario}",
            f"architecture.path={trained.path}",
            "plan.weights=true",
            f"plan.rank={rank}",
            f"plan.rounds={rounds}",
            f"plan.top_k={top_k}",
            "data.source=jsonl",
            f"data.path={C4}",
            f"results.dir={results}",
            f"results.run_id={run_id}",
            *divisors,
            f"scenario.constraints.tpot_ms={factor}x",
            f"scenario.constraints.ttft_ms={factor}x",
        ]
        start = time.time()
        if not reused:
            subprocess.run([sys.executable, "-m", "autocompress.plan", *command], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        meta = json.loads((out / "metadata.json").read_text())
        scored = pd.read_parquet(out / "scored.parquet")
        pick = scored[scored["chosen"]].iloc[0]
        row = {
            "factor": factor,
            "rank": rank,
            "rounds": rounds if rank == "proxy" else None,
            "top_k": top_k,
            "limits": meta["limits"],
            "grid": meta["evaluated"],
            "feasible": meta["feasible"],
            "pick": {k: int(pick[k]) for k in KEYS},
            "params": int(pick["params"]),
            "kl_select": float(pick["kl_select"]),
            "kl_report": meta["pruned"]["kl_report"],
            "perplexity_report": meta["pruned"]["perplexity_report"],
            "selection_measurements": len(scored),
            "calibration_measurements": (meta.get("proxy") or {}).get("measured", 0),
            "seconds": round(meta["seconds"] if reused else time.time() - start, 1),  # reused: the plan's own time
            "command": "python -m autocompress.plan " + " ".join(command),
        }
        if rank == "proxy":
            minitron = results / args.scenario / f"plan-search-{trained.path.name}-{factor}-params" / "scored.parquet"
            row["shared"] = shared(scored, pd.read_parquet(minitron))
        print(json.dumps(row), flush=True)
        return row

    for factor in args.factors:
        rows.append(arm(factor, "params", 1))
        rows += [arm(factor, "proxy", r) for r in args.rounds]
        # Minitron given as many measurements as the last proxy arm made (calibration and selection together), on the selection split
        spent = rows[-1]["calibration_measurements"] + rows[-1]["selection_measurements"]
        if args.equal_budget and spent > 10:
            rows.append(arm(factor, "params", 1, top_k=spent))
    keep = ROOT / "benchmarks" / "results" / "nemotron_h_search"
    keep.mkdir(parents=True, exist_ok=True)
    record = {
        "_record": run_record.as_dict(),
        "model": {"path": trained.path.name, "recipe": trained.log["recipe"], "loss_last_20": trained.log["loss_last_20"]},
        "runs": rows,
    }
    (keep / f"{args.scenario}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
