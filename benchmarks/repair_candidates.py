"""Issue 15 item 7: how many moves should repair and fill measure per step (`search.candidates`)?

repair (downgrade until every bound holds) and fill (upgrade into the slack) rank the single-decision moves
by the search's final distributions and measure only the best `search.candidates` of them by KL on the
probe sequences. This runs each search once (margin 0, the sweep grid's dual steps, seeds base and base + 1, or the
`--setting`s given; the homogeneous rival off, so every row is the search's own result), then repairs and
fills the same argmax with each candidate count of `--candidates`, all from that one search's final
distributions. Writes benchmarks/results/repair_candidates.json (merging scenarios): per search and count
selection- and report-split KL, parameters, repair / fill steps and the seconds repair + fill took.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/repair_candidates.py --scenario rtx5080_game \
        --candidates 3 8 16 data.source=jsonl data.path=../shared/data/corpora/c4_sample
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import common
import torch
from common import dual_steps, scored

from autocompress.arch.masking import MaskedModel
from autocompress.arch.space import Architecture
from autocompress.config.compose import compose_spec
from autocompress.io import write_json
from autocompress.search.differentiable import evaluate, fill, repair, run_search
from autocompress.search.prepare import prepare


def parse_setting(text: str) -> tuple[float, int]:
    """DUAL_STEP:SEED, e.g. 2.0:0."""
    dual, _, seed = text.partition(":")
    try:
        return float(dual), int(seed)
    except ValueError:
        raise SystemExit(f"--setting {text!r}: give DUAL_STEP:SEED, e.g. 2.0:0") from None


def bench_scenario(name: str, counts: list[int], settings: list[tuple[float, int]], overrides: list[str]) -> dict[str, Any]:
    spec = compose_spec(f"+scenario={name}", "search.homogeneous_candidate=false", *overrides)
    if spec.search.start != "base":
        raise SystemExit(f"search.start={spec.search.start} needs the rival, which this benchmark turns off")
    seed0 = spec.search.settings.seed
    pairs = settings or [(d, seed0 + s) for s in (0, 1) for d in dual_steps(spec.sweep.definition)]
    prep = prepare(spec, progress=False)
    model, inputs, cm, space = prep.base.model, prep.inputs, prep.cost_model, prep.space
    cons = inputs.constraints
    probe = inputs.calib[: spec.search.probe_sequences], inputs.teacher_calib[: spec.search.probe_sequences]
    out: dict[str, Any] = {"scenario": name, "constraints": {c.metric: c.value for c in cons}, "counts": counts, "searches": []}
    for dual, seed in pairs:
        settings_ = dataclasses.replace(spec.search.settings, margin=0.0, dual_lr=dual, seed=seed)
        # its own repair (1 move measured per step, the cheapest) is not used: every count starts from its argmax
        res = run_search(model, inputs, cm, dataclasses.replace(spec.search, fill=False, candidates=1), settings_)
        assert res.argmax is not None
        masked = MaskedModel(model, space, inputs.ranking)

        def quality(a: Architecture, masked: MaskedModel = masked) -> float:
            return evaluate(model, masked, a, *probe)[0]

        def row(a: Architecture, masked: MaskedModel = masked, **extra: Any) -> dict[str, Any]:
            return scored(model, masked, inputs, cm, a, extra)

        rec: dict[str, Any] = {"settings": dataclasses.asdict(settings_), "search_s": res.wall_s, "argmax": row(res.argmax)}
        for n in counts:
            start = time.time()
            repaired, repairs = repair(res.argmax, space, cm, cons, res.logits, quality, n)
            filled, fills = fill(repaired, space, cm, cons, res.logits, quality, settings_.margin, n)
            rec[str(n)] = row(filled, repair_steps=repairs, fill_steps=fills, seconds=time.time() - start)
            r = rec[str(n)]
            print(
                f"{name} dual {dual} seed {seed}, {n} candidates: selection KL {r['kl_select']:.3f}, report KL {r['kl']:.3f}, "
                f"{r['params'] / 1e6:.1f}M, {repairs} repairs + {fills} fills in {r['seconds']:.0f}s",
                flush=True,
            )
        masked.remove()
        out["searches"].append(rec)
    for n in counts:  # each count's pick over the searches, as the sweep picks: the lowest selection KL among the feasible
        rows = [s[str(n)] for s in out["searches"] if s[str(n)]["feasible"]]
        out[f"pick_{n}"] = min(rows, key=lambda r: r["kl_select"]) if rows else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", required=True)
    parser.add_argument("--candidates", type=int, nargs="+", default=[3, 8, 16], help="moves measured per repair / fill step")
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        help="DUAL_STEP:SEED at margin 0 (default: the grid's dual steps, seeds base and base + 1)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--note", default="", help="what else shared the machine (recorded beside the CPU)")
    parser.add_argument("--table", type=Path, default=Path("benchmarks/results/repair_candidates.json"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.source=jsonl data.path=...")
    args = parser.parse_args()
    record = common.Record(args.note)
    if any(n < 1 for n in args.candidates):
        raise SystemExit(f"--candidates {args.candidates}: each count must be at least 1")
    torch.set_num_threads(args.threads)
    settings = [parse_setting(s) for s in args.setting]
    args.table.parent.mkdir(parents=True, exist_ok=True)  # a bad path fails now, not after the first scenario
    table: dict[str, Any] = json.loads(args.table.read_text()) if args.table.exists() else {}
    for name in args.scenario:
        start = time.time()
        result = bench_scenario(name, args.candidates, settings, args.overrides)
        counts = " ".join(map(str, args.candidates))
        command = f"benchmarks/repair_candidates.py --threads {args.threads} --scenario {name} --candidates {counts}"
        command += "".join(f" --setting {s}" for s in args.setting) + " " + " ".join(args.overrides)
        result["_run"] = {"command": command.strip(), "_record": record.as_dict(), "wall_s": time.time() - start}
        table[name] = result
        write_json(table, args.table)  # after every scenario: an interrupted run keeps what it measured


if __name__ == "__main__":
    main()
