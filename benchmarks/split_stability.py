"""Does a second seed of the document split reorder the top of a sweep's Pareto front?

Re-scores every finished trial of a sweep run on the selection split of another `data.seed`
(other documents, other windows; the run's importance ranking and architectures unchanged) and
compares the order by selection KL with the run's own: Spearman over all trials, whether the best
trial and the top 3 stay the same, and the largest KL change. Prints JSON.

    .venv/bin/python benchmarks/split_stability.py results/rtx5070_coding/RUN --seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from scipy.stats import spearmanr

from autocompress.arch import Architecture, SearchSpace
from autocompress.data import load_token_data
from autocompress.importance import teacher_hidden
from autocompress.masking import MaskedModel, Ranking
from autocompress.models import load_base_model
from autocompress.results import load_run
from autocompress.search import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run")
    parser.add_argument("--seed", type=int, default=1, help="the other data.seed")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = load_run(args.run)
    assert run.spec is not None
    spec = run.spec
    base = load_base_model(spec.model)
    space = SearchSpace.from_base(Architecture.from_llama_config(base.model.config), spec.search.space)
    ranking = Ranking.load(Path(args.run) / "ranking.safetensors")
    other = load_token_data(dataclasses.replace(spec.data, seed=args.seed), base.tokenizer, splits=("select",)).select
    teacher = teacher_hidden(base.model, other, progress=False)
    ok = run.trials[run.trials["status"] == "ok"].reset_index(drop=True)
    masked = MaskedModel(base.model, space, ranking)
    again = [evaluate(base.model, masked, Architecture.from_json(a), other, teacher)[0] for a in ok["architecture"]]
    masked.remove()
    first = ok["kl_select"].tolist()
    order_a = sorted(range(len(ok)), key=lambda i: first[i])
    order_b = sorted(range(len(ok)), key=lambda i: again[i])
    feasible = ok["feasible"].tolist()
    best_a = next(i for i in order_a if feasible[i])
    best_b = next(i for i in order_b if feasible[i])
    out = {
        "run": str(args.run),
        "trials": len(ok),
        "select_sequences": spec.data.select_sequences,
        "seq_len": spec.data.seq_len,
        "spearman": float(spearmanr(first, again).statistic),
        "best_feasible_same": ok["trial_id"][best_a] == ok["trial_id"][best_b],
        "top3_same_set": {ok["trial_id"][i] for i in order_a[:3]} == {ok["trial_id"][i] for i in order_b[:3]},
        "max_abs_kl_change": max(abs(x - y) for x, y in zip(first, again, strict=True)),
        "kl_select": dict(zip(ok["trial_id"], first, strict=True)),
        f"kl_select_seed{args.seed}": dict(zip(ok["trial_id"], again, strict=True)),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
