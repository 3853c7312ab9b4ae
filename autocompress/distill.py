"""`python -m autocompress.distill STUDENT out=DIR`: recover a pruned checkpoint by distillation from the unpruned teacher.

Loss per token = T^2 KL(softmax(teacher / T) || softmax(student / T)) (+ w * ||P h_s - h_t||^2 / ||h_t||^2 on the
final hidden states, P a learned projection initialised by least squares). The text is the calibration source
(`data.*`, the Python standard library by default; never evaluation data), cut into `tokens / (batch * seq_len)`
steps of AdamW with warm-up and cosine decay. Every `save_every` steps the student, optimiser and loss log are
saved beside the output (`.<out>.distill/`); a rerun with the same settings resumes there. The distilled model
appears at `out` only when training has finished (temp folder, then rename).
"""

from __future__ import annotations

import sys
from pathlib import Path

from autocompress.config.build import build
from autocompress.config.schema import DataSpec, ModelSpec
from autocompress.errors import ConfigError
from autocompress.quality.distillation import DistillSpec, distill, work_dir
from autocompress.quality.tasks import DEFAULT_CORPUS, evaluation_paths

# --------------------------------------------------------------------------- entry point

USAGE = """\
usage: python -m autocompress.distill STUDENT out=DIR [tokens=N] [KEY=VALUE ...] [overwrite=true] [resume=false]

  STUDENT         a pruned checkpoint folder (python -m autocompress.export ... out=STUDENT)
  out=DIR         the distilled checkpoint (appears when training ends; the resumable state lives in .DIR.distill/)
  tokens=N        the training-token budget; also seq_len, batch_size, lr, temperature, hidden_weight, save_every, ...
                  (conf/distill/default.yaml)
  teacher=DIR     the teacher (default `base`: the configured model=...; the student must be pruned from it)
  data.source=... the distillation text (default the calibration source: Python stdlib sources); never evaluation data
  overwrite=true  replace a checkpoint already in out=DIR (refused otherwise; a folder of other files always)
  resume=false    start over instead of resuming an interrupted run with the same settings"""


def main(argv: list[str] | None = None) -> int:
    from autocompress.config.cliargs import run_command

    return run_command(argv, USAGE, _distill_command)


def _distill_command(args: list[str]) -> None:
    from autocompress.config.cliargs import UsageError, flag, parse
    from autocompress.io import check_output
    from autocompress.model.base import check_model_folder
    from autocompress.model.checkpoint import BASE, load_checkpoint

    cmd = parse(args, "distill", DistillSpec, options=("out", "teacher", "overwrite", "resume"))
    if len(cmd.positional) != 1 or not cmd.options.get("out"):
        raise UsageError("give the STUDENT checkpoint folder and out=DIR")
    overwrite, resume = (flag(k, cmd.options.get(k, default)) for k, default in (("overwrite", "false"), ("resume", "true")))
    check_output(Path(cmd.options["out"]), overwrite, what="a checkpoint")  # before any model loads
    spec = build(DistillSpec, cmd.config.get("distill") or {}, "distill")
    data = build(DataSpec, cmd.config.get("data") or {}, "data")
    base = build(ModelSpec, cmd.config.get("model"), "model")
    student = Path(cmd.positional[0])
    if not (student / "config.json").exists():
        raise ConfigError(f"{student} is not a checkpoint folder (no config.json); export one with python -m autocompress.export")
    config = check_model_folder(student, "STUDENT", families=None, tokenizer=False) or {}
    teacher = load_checkpoint(cmd.options.get("teacher", BASE), base)
    if config.get("vocab_size") != teacher.model.config.vocab_size:
        raise ConfigError(
            f"the student {student} has a vocabulary of {config.get('vocab_size')} tokens and the teacher {teacher.name} "
            f"{teacher.model.config.vocab_size}: distil a student from the model it was pruned from (teacher=DIR or model=NAME)"
        )
    ev = cmd.config.get("evaluate") or {}
    forbid = (*evaluation_paths(), *evaluation_paths(ev.get("data_dir"), ev.get("corpus", DEFAULT_CORPUS)))
    out = Path(cmd.options["out"])
    try:
        res = distill(student, out, teacher.model, teacher.tokenizer, data, spec, overwrite, resume, evaluation_dirs=forbid)
    except KeyboardInterrupt:
        kept = (
            f"its state at the last save (every {spec.save_every} steps) is in {work_dir(out)}"
            if work_dir(out).exists()
            else "no state was saved yet"
        )
        raise KeyboardInterrupt(f"distillation into {out} stopped; {kept}: rerun the same command to resume") from None
    resumed = f" (resumed at step {res.resumed_from})" if res.resumed_from else ""
    print(f"distilled {res.steps} steps, {res.tokens:,} tokens{resumed} in {res.wall_s:.0f}s -> {res.out}")
    kl = f"{res.kl_before:.4f} -> {res.kl_after:.4f}"
    print(f"report-split KL(teacher || student): {kl} nats/token; loss log: {res.out / 'distill_log.csv'}")


if __name__ == "__main__":
    sys.exit(main())
