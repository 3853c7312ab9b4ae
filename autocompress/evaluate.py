"""`python -m autocompress.evaluate MODEL`: zero-shot accuracy by log-likelihood (lm-evaluation-harness's metrics) and perplexity.

Multiple choice: the log-likelihood of every answer given the prompt; `acc` takes the largest sum,
`acc_norm` the largest sum divided by the answer's length in characters (`len(choice)` of the answer
without its leading space, as lm-evaluation-harness's multiple-choice `process_results`; its
byte-normalised variant is `acc_bytes`, not computed here). LAMBADA: `acc` = every target token is the
greedy one, `perplexity` = exp(-mean over items of the target's log-likelihood). Corpus perplexity: exp
of the mean token NLL over disjoint windows of a text file. The average is the mean over the benchmarks
of each one's headline metric (`tasks.TASKS`).

Not lm-evaluation-harness's numbers where: `limit=N` takes a fixed-seed random subset (lm-eval's
`--limit` takes the first N); the local HellaSwag file cannot recover lm-eval's capitalised ctx_b and
`sciq_closedbook` has no support passage (`tasks` module docstring); WinoGrande's acc_norm is reported
(equal to acc), which lm-eval's winogrande does not; requests longer than `max_length` keep their last
tokens at 2048 by default (lm-eval: the model's maximum length); the model runs in the dtype it was
loaded in (source=lm-eval: float32).
"""

from __future__ import annotations

import sys
from pathlib import Path

from autocompress.config.build import build
from autocompress.config.schema import ModelSpec
from autocompress.quality.evaluation import EVAL_MARKER, EvalSpec, corpus_path, evaluate_lm_eval, evaluate_model, table, write_result

# --------------------------------------------------------------------------- entry point

USAGE = """\
usage: python -m autocompress.evaluate MODEL [out=DIR] [overwrite=true] [limit=N] [tasks=a,b] [KEY=VALUE ...]

  MODEL           a checkpoint folder (export, distilled model, any Llama-family model) or `base` (the configured model=...)
  out=DIR         write items.parquet, scores.parquet, eval.json there (default: results/evaluate/<MODEL name>)
  overwrite=true  replace an earlier evaluation in out= (an existing out= is refused otherwise; never a folder of other files)
  limit=N         a fixed-seed subset of N items per benchmark (seed=S); 0 = all
  tasks=a,b       some of: hellaswag piqa arc_easy arc_challenge winogrande openbookqa sciq_closedbook sciq lambada_openai
                  (default: all but sciq from local files, all but sciq_closedbook otherwise; sciq_closedbook is
                  SciQ without its support passage, sciq is lm-eval's with it, from source=hub or source=lm-eval)
  data_dir=PATH   the evaluation-data folder (default <repo>/../shared/data); source=hub reads a dataset hub,
                  source=lm-eval runs lm-evaluation-harness on the same checkpoint
  corpus=FILE     the perplexity corpus (relative to data_dir; null = none); more keys: conf/evaluate/default.yaml
  model=NAME      the base model (conf/model/), for `base` and for folders without a tokenizer"""


def main(argv: list[str] | None = None) -> int:
    from autocompress.config.cliargs import run_command

    return run_command(argv, USAGE, _evaluate_command)


def _evaluate_command(args: list[str]) -> None:
    from autocompress.config.cliargs import UsageError, parse
    from autocompress.io import check_output
    from autocompress.model.checkpoint import load_checkpoint

    cmd = parse(args, "evaluate", EvalSpec, options=("out", "overwrite"))
    if len(cmd.positional) != 1:
        raise UsageError("give exactly one MODEL (a checkpoint folder or `base`)")
    spec = build(EvalSpec, cmd.config.get("evaluate") or {}, "evaluate")
    base = build(ModelSpec, cmd.config.get("model"), "model")
    target = cmd.positional[0]
    if "out" in cmd.options and not str(cmd.options["out"]).strip():
        raise UsageError("out= is empty; give a folder or leave it out")
    overwrite = str(cmd.options.get("overwrite", "false")).lower()
    if overwrite not in ("true", "false"):
        raise UsageError(f"overwrite={overwrite}: expected true or false")
    out = Path(cmd.options.get("out") or Path(cmd.config["results"]["dir"]) / "evaluate" / Path(target).name)
    check_output(out, overwrite == "true", marker=EVAL_MARKER, what="an evaluation")  # before the evaluation, not after it
    if spec.source != "lm-eval":
        corpus_path(spec)  # a missing, empty or binary corpus is refused before the model loads, not after the benchmarks
    if spec.source == "lm-eval":
        result = evaluate_lm_eval(target, spec)
    else:
        loaded = load_checkpoint(target, base)
        result = evaluate_model(loaded.model, loaded.tokenizer, spec, name=loaded.name)
    write_result(result, out)
    print(table(result))
    print(f"\nresults: {out / 'scores.parquet'} (per item: {out / 'items.parquet'}); {result.meta['wall_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
