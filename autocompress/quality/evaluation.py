"""Scoring a model on the evaluation tasks as lm-evaluation-harness does (log-likelihoods, acc / acc_norm), corpus perplexity."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from autocompress.errors import ConfigError
from autocompress.io import staged
from autocompress.quality.loglik import Group, encode_item, loglikelihoods
from autocompress.quality.tasks import (
    DEFAULT_CORPUS,
    TASKS,
    Item,
    check_source,
    check_task_names,
    data_dir,
    default_tasks,
    load_items,
    parse_exclude,
)


@dataclass(frozen=True)
class EvalSpec:
    """What to evaluate and how (conf/evaluate/default.yaml)."""

    tasks: tuple[str, ...] | None = None  # None: tasks.default_tasks(source) (SciQ: sciq_closedbook locally, else sciq)
    limit: int = 200  # items per benchmark, a fixed-seed subset; 0 = all
    seed: int = 0
    exclude: tuple[str, ...] = ()  # LIMIT:SEED subsets whose items are left out first (items seen while choosing defaults)
    source: Literal["local", "hub", "lm-eval"] = "local"
    data_dir: str | None = None  # null = <repo>/../shared/data
    corpus: str | None = DEFAULT_CORPUS  # relative to data_dir, or absolute; null = no corpus perplexity
    corpus_seq_len: int = 512
    corpus_windows: int = 32  # fixed-seed subset of the corpus's disjoint windows; 0 = all
    batch_tokens: int = 4096  # padded tokens per forward
    max_length: int = 2048  # longer requests keep their last tokens (as lm-evaluation-harness does)
    threads: int = 0  # torch threads; 0 = torch's default

    def __post_init__(self) -> None:
        if self.tasks is None:
            object.__setattr__(self, "tasks", default_tasks(self.source))
        check_task_names(self.names)
        for key in ("limit", "corpus_windows", "threads", "corpus_seq_len", "batch_tokens", "max_length"):
            low = 0 if key in ("limit", "corpus_windows", "threads") else 1
            if getattr(self, key) < low:
                raise ConfigError(f"evaluate.{key} must be >= {low}, got {getattr(self, key)!r}")
        if self.source not in ("local", "hub", "lm-eval"):
            raise ConfigError(f"evaluate.source={self.source!r} is unknown; use local, hub or lm-eval")
        check_source(self.names, self.source)  # e.g. sciq from local files: before any model is loaded
        parse_exclude(self.exclude)
        if self.exclude and self.source == "lm-eval":
            raise ConfigError("evaluate.exclude: lm-evaluation-harness takes the first N items; use source=local or hub")

    @property
    def names(self) -> tuple[str, ...]:
        """The benchmarks to run (`tasks`, or the default for `source`)."""
        return self.tasks if self.tasks is not None else default_tasks(self.source)


# --------------------------------------------------------------------------- scoring


def choice_metrics(item: Item, lls: Sequence[float]) -> dict[str, float]:
    """acc: argmax of the summed log-likelihoods is gold; acc_norm: argmax of log-likelihood / characters of the answer.

    Characters as lm-evaluation-harness counts them: `len(choice)` of the answer text without the leading space
    (Python str length, not UTF-8 bytes); ties go to the first choice (np.argmax). An empty answer counts as 1
    character here (lm-eval would divide by zero).
    """
    norm = [ll / max(1, len(c)) for ll, c in zip(lls, item.choices, strict=True)]
    return {"acc": float(int(np.argmax(lls)) == item.gold), "acc_norm": float(int(np.argmax(norm)) == item.gold), "loglik": lls[item.gold]}


def last_word_metrics(ll: float, greedy: bool) -> dict[str, float]:
    return {"acc": float(greedy), "loglik": ll}


def score_task(model: Any, tokenizer: Any, items: list[Item], spec: EvalSpec, progress: bool = True) -> pd.DataFrame:
    """One row per item: task, index, acc, acc_norm (multiple choice), loglik (of the gold answer / target), correct (headline)."""
    if not items:
        return pd.DataFrame(columns=["task", "index", "acc", "acc_norm", "loglik", "correct"])
    task = TASKS[items[0].task]
    groups = [encode_item(tokenizer, it) for it in items]
    results = loglikelihoods(model, [g for gs in groups for g in gs], spec.batch_tokens, spec.max_length, desc=task.name, progress=progress)
    rows, start = [], 0
    for it, gs in zip(items, groups, strict=True):
        res = [r for group in results[start : start + len(gs)] for r in group]
        start += len(gs)
        metrics = choice_metrics(it, [ll for ll, _ in res]) if task.kind == "choice" else last_word_metrics(*res[0])
        rows.append({"task": it.task, "index": it.index, **metrics})
    df = pd.DataFrame(rows)
    if "acc_norm" not in df:
        df["acc_norm"] = np.nan
    df["correct"] = df[task.headline]
    return df[["task", "index", "acc", "acc_norm", "loglik", "correct"]]


def corpus_windows(tokenizer: Any, path: Path, seq_len: int, windows: int, seed: int) -> list[list[int]]:
    """Disjoint `seq_len`-token windows of the file's tokens (a fixed-seed subset of `windows` of them, in order)."""
    ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
    chunks = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not chunks:
        raise ConfigError(f"{path} holds {len(ids)} tokens, fewer than evaluate.corpus_seq_len={seq_len}; lower it")
    if 0 < windows < len(chunks):
        chunks = [chunks[i] for i in sorted(random.Random(f"{seed}:corpus").sample(range(len(chunks)), windows))]
    return chunks


def corpus_perplexity(model: Any, tokenizer: Any, path: Path, spec: EvalSpec, progress: bool = True) -> tuple[float, int]:
    """(exp of the mean NLL of every token after the first of each window, tokens scored)."""
    chunks = corpus_windows(tokenizer, path, spec.corpus_seq_len, spec.corpus_windows, spec.seed)
    groups: list[Group] = [(w[:1], [w[1:]]) for w in chunks]
    results = loglikelihoods(model, groups, spec.batch_tokens, max(spec.max_length, spec.corpus_seq_len), desc="corpus", progress=progress)
    tokens = sum(len(w) - 1 for w in chunks)
    return math.exp(-sum(res[0][0] for res in results) / tokens), tokens


def corpus_path(spec: EvalSpec) -> Path | None:
    """The perplexity corpus, checked before any scoring: a file that exists and holds text (not empty, not binary)."""
    if spec.corpus is None:
        return None
    path = Path(spec.corpus)
    path = path if path.is_absolute() else data_dir(spec.data_dir) / path
    if not path.is_file():
        raise ConfigError(
            f"corpus file {path} is missing; point evaluate.corpus at a text file (or evaluate.data_dir), "
            "or skip it with evaluate.corpus=null"
        )
    with path.open("rb") as fh:
        head = fh.read(1 << 16)
    if not head.strip():
        raise ConfigError(f"corpus file {path} is empty; point evaluate.corpus at a text file, or skip it with evaluate.corpus=null")
    if b"\0" in head or head.decode("utf-8", errors="replace").count("\ufffd") > len(head) // 100:
        raise ConfigError(f"corpus file {path} is not UTF-8 text (binary data); point evaluate.corpus at a text file")
    return path


def stderr(values: pd.Series) -> float:
    """Sample standard error of a mean (lm-evaluation-harness's for acc)."""
    n = len(values)
    return float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")


def task_scores(items: pd.DataFrame) -> pd.DataFrame:
    """task, metric, value, stderr, n, headline: acc and acc_norm per benchmark, LAMBADA perplexity."""
    rows = []
    for name, df in items.groupby("task", sort=False):
        task = TASKS[str(name)]
        metrics = ["acc", "acc_norm"] if task.kind == "choice" else ["acc"]
        for m in metrics:
            rows.append(
                {
                    "task": name,
                    "metric": m,
                    "value": float(df[m].mean()),
                    "stderr": stderr(df[m]),
                    "n": len(df),
                    "headline": m == task.headline,
                }
            )
        if task.kind == "last_word":
            ppl = math.exp(-float(df["loglik"].mean()))
            rows.append({"task": name, "metric": "perplexity", "value": ppl, "stderr": float("nan"), "n": len(df), "headline": False})
    return pd.DataFrame(rows)


def average(scores: pd.DataFrame) -> float:
    """Mean over the benchmarks of their headline metric."""
    head = scores[scores["headline"] & (scores["task"] != "average")]
    return float(head["value"].mean()) if len(head) else float("nan")


# --------------------------------------------------------------------------- running an evaluation


@dataclass
class EvalResult:
    items: pd.DataFrame  # one row per benchmark item (see score_task)
    scores: pd.DataFrame  # task, metric, value, stderr, n, headline (incl. average and corpus perplexity)
    meta: dict[str, Any]

    def score(self, task: str, metric: str | None = None) -> float:
        df = self.scores[self.scores["task"] == task]
        df = df[df["headline"]] if metric is None else df[df["metric"] == metric]
        return float(df["value"].iloc[0]) if len(df) else float("nan")


def evaluate_model(model: Any, tokenizer: Any, spec: EvalSpec, name: str = "model", progress: bool = True) -> EvalResult:
    """Every configured benchmark (and the corpus perplexity) for an already-loaded model."""
    if spec.source == "lm-eval":
        raise ConfigError("evaluate.source=lm-eval evaluates a checkpoint folder: use evaluate_checkpoint (or the CLI)")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    root = data_dir(spec.data_dir)
    corpus = corpus_path(spec)  # fail before any work when it is missing
    loaded = {
        t: load_items(t, spec.source, root, spec.limit, spec.seed, parse_exclude(spec.exclude)) for t in spec.names
    }  # likewise for benchmark files
    frames, seconds = [], {}
    model.eval()
    for n, (task, items) in enumerate(loaded.items(), 1):
        start = time.time()
        frames.append(score_task(model, tokenizer, items, spec, progress))
        seconds[task] = time.time() - start
        if progress:
            acc = frames[-1]["correct"].mean()
            tqdm.write(
                f"[evaluate] {name}: {task} ({n}/{len(loaded)}) {TASKS[task].headline}={acc:.4f} "
                f"on {len(items)} items in {seconds[task]:.0f}s"
            )
    items_df = pd.concat(frames, ignore_index=True)
    scores = task_scores(items_df)
    extra = [
        {"task": "average", "metric": "headline", "value": average(scores), "stderr": float("nan"), "n": len(spec.names), "headline": True}
    ]
    if corpus is not None:
        start = time.time()
        ppl, tokens = corpus_perplexity(model, tokenizer, corpus, spec, progress)
        seconds["corpus"] = time.time() - start
        extra.append({"task": "corpus", "metric": "perplexity", "value": ppl, "stderr": float("nan"), "n": tokens, "headline": False})
    scores = pd.concat([scores, pd.DataFrame(extra)], ignore_index=True)
    meta = {"model": name, "spec": dataclasses.asdict(spec), "seconds": seconds, "wall_s": sum(seconds.values())}
    return EvalResult(items_df, scores, meta)


def evaluate_lm_eval(path: str, spec: EvalSpec) -> EvalResult:
    """The same benchmarks through lm-evaluation-harness (`pip install 'autocompress[lm-eval]'`; needs a dataset hub)."""
    try:
        import lm_eval
    except ImportError as exc:
        raise ConfigError(
            "evaluate.source=lm-eval needs lm-evaluation-harness: pip install 'autocompress[lm-eval]' (and a dataset hub)"
        ) from exc
    start = time.time()
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={path},trust_remote_code=True,dtype=float32",
        tasks=[TASKS[t].lm_eval for t in spec.names],
        num_fewshot=0,
        limit=spec.limit or None,
        random_seed=spec.seed,
        batch_size=1,
    )
    rows = []
    for t in spec.names:
        res = out["results"][TASKS[t].lm_eval]
        for metric in ("acc", "acc_norm", "perplexity"):
            if f"{metric},none" in res:
                rows.append(
                    {
                        "task": t,
                        "metric": metric,
                        "value": float(res[f"{metric},none"]),
                        "stderr": float(res.get(f"{metric}_stderr,none", "nan")),
                        "n": int(out.get("n-samples", {}).get(TASKS[t].lm_eval, {}).get("effective", 0)),
                        "headline": metric == TASKS[t].headline,
                    }
                )
    scores = pd.DataFrame(rows)
    scores = pd.concat(
        [
            scores,
            pd.DataFrame(
                [
                    {
                        "task": "average",
                        "metric": "headline",
                        "value": average(scores),
                        "stderr": float("nan"),
                        "n": len(spec.names),
                        "headline": True,
                    }
                ]
            ),
        ],
        ignore_index=True,
    )
    items = pd.DataFrame(columns=["task", "index", "acc", "acc_norm", "loglik", "correct"])  # lm-eval's samples are not mapped
    return EvalResult(items, scores, {"model": path, "spec": dataclasses.asdict(spec), "wall_s": time.time() - start, "backend": "lm-eval"})


# --------------------------------------------------------------------------- files and tables


EVAL_MARKER = "eval.json"  # what makes a folder an evaluation (the only kind write_result replaces)


def write_result(result: EvalResult, out: Path) -> Path:
    """items.parquet, scores.parquet, eval.json in `out`, which appears whole (temp folder, then rename); an earlier
    evaluation there is replaced, a folder of anything else refused (callers check first: evaluate's out=, overwrite=)."""
    with staged(out, overwrite=True, marker=EVAL_MARKER, what="an evaluation") as tmp:
        tmp.mkdir(parents=True)
        result.items.to_parquet(tmp / "items.parquet", index=False)
        result.scores.to_parquet(tmp / "scores.parquet", index=False)
        (tmp / EVAL_MARKER).write_text(json.dumps(result.meta, indent=2, default=str) + "\n", encoding="utf-8")
    return out


def read_result(out: Path) -> EvalResult:
    if not (out / "eval.json").exists():
        raise ConfigError(f"{out} is not an evaluation folder (no eval.json); run python -m autocompress.evaluate MODEL out={out}")
    meta = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    return EvalResult(pd.read_parquet(out / "items.parquet"), pd.read_parquet(out / "scores.parquet"), meta)


def table(result: EvalResult) -> str:
    """Headline metric per benchmark (in points), the average, and the perplexities."""
    lines = [f"{'benchmark':<16} {'metric':<10} {'score':>8} {'± stderr':>9} {'n':>6}"]
    for _, r in result.scores.iterrows():
        scale = 100.0 if r["metric"] in ("acc", "acc_norm", "headline") else 1.0
        err = "" if math.isnan(r["stderr"]) else f"{scale * r['stderr']:.2f}"
        lines.append(f"{r['task']:<16} {r['metric']:<10} {scale * r['value']:>8.2f} {err:>9} {int(r['n']):>6}")
    return "\n".join(lines)
