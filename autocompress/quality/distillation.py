"""Recovering a pruned model by knowledge distillation from the unpruned teacher (logit KL, optional hidden-state loss), resumable."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from autocompress.config.schema import DataSpec
from autocompress.errors import ConfigError
from autocompress.io import atomic_write, check_output, staged
from autocompress.io import log as log_line
from autocompress.model.data import load_token_data
from autocompress.model.scores import kl_of_log_probs, next_token_nll
from autocompress.quality.tasks import evaluation_paths

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class DistillSpec:
    """Distillation budget and optimiser (conf/distill/default.yaml)."""

    tokens: int = 65536  # training tokens (steps = tokens / (batch_size * seq_len), rounded up)
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 1e-4  # peak AdamW step
    min_lr_ratio: float = 0.1  # cosine decay down to lr * this
    warmup_steps: int = 8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max gradient norm; 0 = none
    temperature: float = 1.0
    hidden_weight: float = 0.0  # weight of the final-hidden-state term; 0 = logit KL only
    save_every: int = 16  # steps between resumable checkpoints
    eval_sequences: int = 8  # report-split sequences of the calibration source for the KL before and after
    threads: int = 0  # torch threads; 0 = torch's default
    seed: int = 0  # which calibration windows (from the same calibration documents), in which order; 0 = the sweep's

    def __post_init__(self) -> None:
        for key in ("tokens", "seq_len", "batch_size", "lr", "temperature", "save_every", "eval_sequences"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"distill.{key} must be > 0, got {getattr(self, key)!r}")
        for key in ("warmup_steps", "weight_decay", "grad_clip", "hidden_weight", "threads"):
            if getattr(self, key) < 0:
                raise ConfigError(f"distill.{key} must be >= 0, got {getattr(self, key)!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"distill.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / (self.batch_size * self.seq_len))


@dataclass
class DistillResult:
    out: Path
    steps: int
    tokens: int
    kl_before: float  # report-split KL(teacher || student), nats/token
    kl_after: float
    wall_s: float  # this invocation
    resumed_from: int  # step the run started at (0 = from scratch)
    log: list[dict[str, float]]


def check_not_evaluation_data(data: DataSpec, evaluation_dirs: tuple[Path, ...]) -> None:
    """Refuse distillation text that is, lies in, or contains evaluation data (benchmarks must never be trained on)."""
    if data.source in ("stdlib", "hf") or data.path is None:
        return
    path = Path(data.path).expanduser().resolve()
    for folder in evaluation_dirs:
        folder = folder.expanduser().resolve()
        if path == folder or folder in path.parents or path in folder.parents:
            raise ConfigError(
                f"data.path={data.path} lies in or holds the evaluation data ({folder}); distil on calibration text instead "
                "(the default data.source=stdlib, ../shared/data/corpora/c4_sample, or your own corpus)"
            )


# --------------------------------------------------------------------------- losses


def forward(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [b, s, d], logits [b, s, V])."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    return hidden, model.lm_head(hidden)


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """T^2 * mean over tokens of KL(softmax(teacher / T) || softmax(student / T))."""
    logp_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    logp_t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return kl_of_log_probs(logp_s, logp_t) * temperature**2


def hidden_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, proj: torch.nn.Linear) -> torch.Tensor:
    """||P h_s - h_t||^2 / ||h_t||^2 over all tokens (scale-free)."""
    t = teacher_hidden.float()
    return (proj(student_hidden.float()) - t).pow(2).sum() / t.pow(2).sum().clamp_min(1e-12)


def init_projection(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.nn.Linear:
    """Linear map student -> teacher hidden states fitted by least squares on one batch."""
    x, y = student_hidden.detach().float().flatten(0, -2), teacher_hidden.detach().float().flatten(0, -2)
    proj = torch.nn.Linear(x.shape[-1], y.shape[-1], bias=False)
    with torch.no_grad():
        proj.weight.copy_(torch.linalg.lstsq(x, y).solution.T)
    return proj


@torch.no_grad()
def heldout_kl(student: Any, teacher: Any, tokens: torch.Tensor, batch_size: int = 4) -> float:
    """Mean KL(teacher || student) per token on `tokens` [n, s]."""
    total = 0.0
    for start in range(0, len(tokens), batch_size):
        ids = tokens[start : start + batch_size]
        total += float(kl_loss(forward(student, ids)[1], forward(teacher, ids)[1])) * ids.numel()
    return total / tokens.numel()


@torch.no_grad()
def heldout_scores(student: Any, teacher: Any, tokens: torch.Tensor, batch_size: int = 4) -> dict[str, float]:
    """KL(teacher || student) per token and the student's perplexity (next-token NLL) on `tokens` [n, s]."""
    kl, nll, n_nll = 0.0, 0.0, 0
    for start in range(0, len(tokens), batch_size):
        ids = tokens[start : start + batch_size]
        logp = torch.log_softmax(forward(student, ids)[1].float(), dim=-1)  # once: the KL's and the NLL's
        logp_t = torch.log_softmax(forward(teacher, ids)[1].float(), dim=-1)
        kl += float(kl_of_log_probs(logp, logp_t)) * ids.numel()
        nll += next_token_nll(logp, ids)
        n_nll += ids[:, 1:].numel()
    return {"kl": kl / tokens.numel(), "perplexity": math.exp(nll / n_nll), "tokens": int(tokens.numel())}


def lr_factor(step: int, spec: DistillSpec) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at the last step."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    span = max(1, spec.steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- resumable state


def work_dir(out: Path) -> Path:
    """Where the resumable state of a distillation into `out` lives (beside it)."""
    return out.with_name(f".{out.name}.distill")


# A non-zero seed's training windows since commit 73bc6e8 (before, every seed trained on seed 0's): part of the
# identity of a seeded run, so neither a resumable state nor a finished compare stage from before is taken for one.
SEEDED_WINDOWS = "calib_seed/73bc6e8"


def seeded_identity(seed: int) -> dict[str, str]:
    """What a distillation's identity (resume fingerprint, compare stage keys) adds for `seed`: nothing for seed 0."""
    return {"windows": SEEDED_WINDOWS} if seed else {}


def _student_digest(student_dir: Path) -> str:
    """What the student is, not only where: its config and weight files' bytes (another trial in the same folder differs)."""
    h = hashlib.sha256()
    for f in sorted(student_dir.iterdir()):
        if f.is_file() and (f.name == "config.json" or f.suffix in (".safetensors", ".bin")):
            h.update(f.name.encode())
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def _teacher_digest(teacher: Any) -> str:
    """The teacher's config and a checksum of its weights (another teacher or checkpoint differs)."""
    config: Any = getattr(teacher, "config", None)
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else type(teacher).__name__
    with torch.no_grad():
        total = sum(float(p.detach().double().sum()) for p in teacher.parameters())
    return hashlib.sha256(f"{text}|{total:.10e}".encode()).hexdigest()[:16]


def fingerprint(student_dir: Path, spec: DistillSpec, data: DataSpec, teacher: Any = None) -> dict[str, Any]:
    """A resumable state's identity: the student (path and content), the teacher, the settings, the text, the seed's windows."""
    out = {"student": str(student_dir.resolve()), "distill": dataclasses.asdict(spec), "data": dataclasses.asdict(data)}
    out["student_digest"] = _student_digest(student_dir)
    if teacher is not None:
        out["teacher"] = _teacher_digest(teacher)
    return out | seeded_identity(spec.seed)


def _save_state(path: Path, state: dict[str, Any]) -> None:
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def _write_log(path: Path, log: list[dict[str, float]]) -> None:
    def write(tmp: Path) -> None:
        with tmp.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(log[0]) if log else ["step"])
            writer.writeheader()
            writer.writerows(log)

    atomic_write(path, write)


def _load_state(work: Path, expected: dict[str, Any], discard_stale: bool = False) -> dict[str, Any] | None:
    path = work / "state.pt"
    if not path.exists():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    if state["fingerprint"] != expected:
        changed = sorted(k for k in expected if state["fingerprint"].get(k) != expected[k])
        if discard_stale:
            log_line(f"{work} holds a distillation with other settings ({', '.join(changed)} differ); starting over")
            shutil.rmtree(work)
            return None
        raise ConfigError(
            f"{work} holds a distillation with other settings ({', '.join(changed)} differ); "
            f"rerun with the same settings to resume it, or add resume=false to start over"
        )
    return state


# --------------------------------------------------------------------------- the loop


def _finish(student: Any, student_dir: Path, out: Path, summary: dict[str, Any], log: list[dict[str, float]]) -> None:
    """Write the distilled checkpoint to `out` whole: weights and config, the source's other files, the log (an earlier
    checkpoint there is replaced: distill() checked `out` before training)."""
    with staged(out, overwrite=True, what="a checkpoint") as tmp:
        student.save_pretrained(tmp)
        for f in student_dir.iterdir():
            if f.is_file() and f.name not in WEIGHT_FILES and not (tmp / f.name).exists():
                shutil.copyfile(f, tmp / f.name)  # tokenizer, DeciLM code, generation config, model card
        _write_log(tmp / "distill_log.csv", log)
        (tmp / "distill.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")


def distill(
    student_dir: Path,
    out: Path,
    teacher: Any,
    tokenizer: Any,
    data: DataSpec,
    spec: DistillSpec,
    overwrite: bool = False,
    resume: bool = True,
    discard_stale: bool = False,
    progress: bool = True,
    on_step: Callable[[dict[str, float]], None] | None = None,
    evaluation_dirs: tuple[Path, ...] = evaluation_paths(),
) -> DistillResult:
    """Distil the checkpoint in `student_dir` from `teacher` (a loaded, frozen model) into `out`.

    `evaluation_dirs`: folders of evaluation data the distillation text must not come from.
    `discard_stale`: a resumable state left by a run with other settings is deleted (start over) rather than
    refused; for callers that own the output folder and key their stages by the settings (compare).
    """
    from autocompress.model.checkpoint import open_model

    check_not_evaluation_data(data, evaluation_dirs)
    check_output(out, overwrite, what="a checkpoint")  # overwrite=true replaces a checkpoint, never a folder of other files
    if out.resolve() == student_dir.resolve():
        raise ConfigError(f"out={out} is the student checkpoint itself; choose another folder")
    start_time = time.time()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    steps, b = spec.steps, spec.batch_size
    limit = getattr(teacher.config, "max_position_embeddings", None)
    if isinstance(limit, int) and spec.seq_len > limit:  # before any text is read or a step is taken
        raise ConfigError(f"distill.seq_len={spec.seq_len} is longer than the teacher's {limit} positions; use <= {limit}")
    tokens = load_token_data(  # trains on the calibration split, measures on the report split (documents no search selected on)
        dataclasses.replace(data, seq_len=spec.seq_len, calib_sequences=steps * b, report_sequences=spec.eval_sequences),
        tokenizer,
        splits=("calib", "report"),
        calib_seed=spec.seed,  # seeds differ in their training text; the report windows (KL before / after) stay the same
        calib_wants="distill.tokens / distill.seq_len windows of distill.seq_len tokens",
    )
    work = work_dir(out)
    expected = fingerprint(student_dir, spec, data, teacher)
    if not resume:
        shutil.rmtree(work, ignore_errors=True)
    state = _load_state(work, expected, discard_stale)
    student = open_model(student_dir)
    teacher.eval().requires_grad_(False)
    proj = None
    if spec.hidden_weight > 0:
        with torch.no_grad():
            proj = init_projection(forward(student, tokens.calib[:b])[0], forward(teacher, tokens.calib[:b])[0])
    params = list(student.parameters()) + (list(proj.parameters()) if proj is not None else [])
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, spec))
    if state is None:
        kl_before, first, log = heldout_kl(student, teacher, tokens.report), 0, []
    else:
        student.load_state_dict(state["student"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        if proj is not None:
            proj.load_state_dict(state["proj"])
        kl_before, first, log = state["kl_before"], state["step"], state["log"]
    student.train()
    bar = tqdm(range(first, steps), desc="distill", initial=first, total=steps, disable=not progress, dynamic_ncols=True)
    for step in bar:
        ids = tokens.calib[step * b : (step + 1) * b]
        with torch.no_grad():
            t_hidden, t_logits = forward(teacher, ids)
        s_hidden, s_logits = forward(student, ids)
        kl = kl_loss(s_logits, t_logits, spec.temperature)
        hid = hidden_loss(s_hidden, t_hidden, proj) if proj is not None else torch.zeros(())
        loss = kl + spec.hidden_weight * hid
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if spec.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        record = {
            "step": step + 1,
            "tokens": (step + 1) * ids.numel(),
            "loss": loss.item(),
            "kl": kl.item(),
            "hidden": hid.item(),
            "lr": lr,
        }
        record["elapsed_s"] = time.time() - start_time
        log.append(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}", kl=f"{record['kl']:.4f}", lr=f"{lr:.2g}", refresh=False)
        if (step + 1) % spec.save_every == 0 and step + 1 < steps:
            work.mkdir(parents=True, exist_ok=True)
            state = {"fingerprint": expected, "step": step + 1, "student": student.state_dict(), "optimizer": opt.state_dict()}
            state |= {"scheduler": sched.state_dict(), "proj": proj.state_dict() if proj is not None else None}
            _save_state(work / "state.pt", {**state, "kl_before": kl_before, "log": log})
            _write_log(work / "distill_log.csv", log)
        if on_step is not None:
            on_step(record)
    bar.close()
    student.eval()
    kl_after = heldout_kl(student, teacher, tokens.report)
    wall = time.time() - start_time
    summary = {
        "student": str(student_dir),
        "steps": steps,
        "tokens": steps * b * spec.seq_len,
        "kl_before": kl_before,
        "kl_after": kl_after,
        "resumed_from": first,
        "wall_s_last_run": wall,
        "spec": dataclasses.asdict(spec),
        "data": dataclasses.asdict(data),
    }
    _finish(student, student_dir, out, summary, log)
    shutil.rmtree(work, ignore_errors=True)
    return DistillResult(out, steps, steps * b * spec.seq_len, kl_before, kl_after, wall, first, log)
