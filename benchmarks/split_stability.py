"""Does another sample of selection text reorder the top of a sweep's Pareto front?

Two second samples, each compared with the run's own order by selection KL (Spearman over all
trials, whether the best feasible trial and the top 3 stay the same, the largest KL change):
- `report`: the run's report split, already in trials.parquet (`kl`): as many windows from other
  documents that neither the search nor the selection saw; no computation;
- `seed`: the selection split of another `data.seed` (re-scored here with the run's ranking and
  architectures). A new seed redraws the whole document split, so some of those documents may have
  been calibration documents of the run: a looser test than `report`.
Prints JSON.

    .venv/bin/python benchmarks/split_stability.py results/rtx5070_coding/RUN --seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import common  # checks that the autocompress imported is this tree's
import torch
from scipy.stats import spearmanr

from autocompress.arch.importance import teacher_hidden
from autocompress.arch.masking import MaskedModel, Ranking
from autocompress.arch.space import Architecture, SearchSpace
from autocompress.io import RunPaths
from autocompress.model.base import load_base_model
from autocompress.model.data import load_token_data
from autocompress.results.store import load_run
from autocompress.search.differentiable import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run")
    parser.add_argument("--seed", type=int, default=None, help="also re-score on the selection split of this data.seed (slow)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    record = common.Record()
    torch.set_num_threads(args.threads)
    run = load_run(args.run)
    assert run.spec is not None
    spec = run.spec
    ok = run.trials[run.trials["status"] == "ok"].reset_index(drop=True)
    first = ok["kl_select"].tolist()
    out = {
        "run": str(args.run),
        "trials": len(ok),
        "select_sequences": spec.data.select_sequences,
        "report_sequences": spec.data.report_sequences,
        "seq_len": spec.data.seq_len,
        "report": agreement(ok, first, ok["kl"].tolist()),
        "kl_select": dict(zip(ok["trial_id"], first, strict=True)),
        "kl_report": dict(zip(ok["trial_id"], ok["kl"], strict=True)),
    }
    if args.seed is not None:
        again = rescore(args, spec, ok)
        out[f"seed{args.seed}"] = agreement(ok, first, again)
        out[f"kl_select_seed{args.seed}"] = dict(zip(ok["trial_id"], again, strict=True))
    out["_record"] = record.as_dict()
    print(json.dumps(out, indent=1))


def rescore(args: argparse.Namespace, spec: Any, ok: Any) -> list[float]:
    """Selection-split KL of every trial on another data.seed's selection split."""
    base = load_base_model(spec.model)
    space = SearchSpace.from_base(Architecture.from_llama_config(base.model.config), spec.search.space)
    ranking = Ranking.load(RunPaths(Path(args.run)).ranking_file)
    other = load_token_data(dataclasses.replace(spec.data, seed=args.seed), base.tokenizer, splits=("select",)).select
    teacher = teacher_hidden(base.model, other, progress=False)
    masked = MaskedModel(base.model, space, ranking)
    again = [evaluate(base.model, masked, Architecture.from_json(a), other, teacher)[0] for a in ok["architecture"]]
    masked.remove()
    return again


def agreement(ok: Any, first: list[float], again: list[float]) -> dict[str, Any]:
    """How far two KL columns of the same trials agree on the order, the best feasible trial and the top 3."""
    order_a = sorted(range(len(ok)), key=lambda i: first[i])
    order_b = sorted(range(len(ok)), key=lambda i: again[i])
    feasible = ok["feasible"].tolist()
    best_a = next(i for i in order_a if feasible[i])
    best_b = next(i for i in order_b if feasible[i])
    return {
        "spearman": float(spearmanr(first, again).statistic),
        "best_feasible_same": bool(ok["trial_id"][best_a] == ok["trial_id"][best_b]),
        "top3_same_set": {ok["trial_id"][i] for i in order_a[:3]} == {ok["trial_id"][i] for i in order_b[:3]},
        "max_abs_kl_change": max(abs(x - y) for x, y in zip(first, again, strict=True)),
    }


if __name__ == "__main__":
    main()
