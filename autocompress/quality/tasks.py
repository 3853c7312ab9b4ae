"""Zero-shot benchmarks in lm-evaluation-harness's framing: items of (context, continuation) requests.

Each benchmark item becomes one request per answer choice (multiple choice) or one request whose
continuation is the target (LAMBADA's last word). Prompts follow lm-evaluation-harness's task
definitions (`Question: ...\\nAnswer:`, a space before every continuation, WinoGrande scored by
partial evaluation: the shared continuation after each filled-in context). Items come from local
files (the layout of `../shared/data/benchmarks`, see its PROVENANCE.md) or from a dataset hub
(the datasets lm-evaluation-harness uses). Evaluation data is read here only: nothing in this
module feeds calibration or distillation.

Where the items differ from lm-evaluation-harness's (docs/commands.md, "Distill and evaluate", lists the rest):

- hellaswag, local file: the file has `activity_label: ctx` with `ctx` = ctx_a + " " + ctx_b joined, so
  lm-eval's `ctx_b.capitalize()` cannot be applied (the boundary is lost): the first item is scored as
  "Roof shingle removal: A man is sitting on a roof. he" where lm-eval has "... roof. He" (and
  `capitalize` also lower-cases the rest of ctx_b). The file was cleaned by its own extractor (drops
  [header]/[step]/[substeps]/[title] tags, per field); lm-eval's `preprocess` is applied on top here, to
  the query and to every ending, so the remaining [bracketed] spans go as in lm-eval, but the two cleaners
  can disagree on a space or a full stop next to a removed tag (`x[title].`: lm-eval `x.`, the file `x`).
  From the hub (`source=hub`) the query is built exactly as lm-eval builds it.
- sciq_closedbook: SciQ's questions without the support passage (the local file has none; from the hub
  the passage is dropped), prompt `Question: ...\\nAnswer:`; locally the choices keep the file's shuffled order. It is
  not lm-eval's `sciq` and has no lm-eval task. `sciq` is lm-eval's (`{support}\\nQuestion: ...\\nAnswer:`,
  the correct answer last) and has no local files: asking for it with source=local is a ConfigError that
  names both ways out. `default_tasks(source)` picks the one the source can give.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from autocompress.errors import ConfigError

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"  # <repo>/../shared/data
DEFAULT_CORPUS = "corpora/tinyshakespeare.txt"  # the perplexity corpus, relative to the data folder


def evaluation_paths(data_dir: str | Path | None = None, corpus: str | None = DEFAULT_CORPUS) -> tuple[Path, ...]:
    """What evaluation reads from a data folder (its benchmarks and its perplexity corpus): never distillation text.

    The folder's other corpora (e.g. corpora/c4_sample, for calibration and distillation) are not evaluation data.
    """
    root = Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    paths = [root / "benchmarks"]
    if corpus:
        paths.append(Path(corpus) if Path(corpus).is_absolute() else root / corpus)
    return tuple(paths)


@dataclass(frozen=True)
class Item:
    """One benchmark item: request i is (contexts[i], continuations[i]); acc_norm divides by `len(choices[i])` (characters)."""

    task: str
    index: int  # position in the source (file line / dataset row), stable across subsets
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    choices: tuple[str, ...]  # answer texts without the leading space, as lm-eval's doc_to_choice (acc_norm: characters)
    gold: int


Kind = Literal["choice", "last_word"]


@dataclass(frozen=True)
class Task:
    """A benchmark: its local files (relative to the data folder), its hub dataset, and how its rows become items."""

    name: str
    kind: Kind
    headline: str  # the metric the average uses: acc or acc_norm
    files: tuple[str, ...]  # empty: no local files (hub only)
    read_local: Callable[[list[Path]], Iterator[dict[str, Any]]] | None
    hub: tuple[str, str | None, str]  # dataset id, config, split (as lm-evaluation-harness loads it)
    from_local: Callable[[int, dict[str, Any]], Item] | None
    from_hub: Callable[[int, dict[str, Any]], Item]
    lm_eval: str | None  # the task's name in lm-evaluation-harness; None: it has no such task
    not_local: str = ""  # why there are no local files (the ConfigError for source=local)


# --------------------------------------------------------------------------- prompt helpers


def hellaswag_preprocess(text: str) -> str:
    """lm-evaluation-harness's HellaSwag cleaning: strip, ' [title]' -> '. ', drop [bracketed] tags, squeeze double spaces."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _choice(task: str, index: int, context: str, choices: list[str], gold: int) -> Item:
    """A multiple-choice item: the same context, each answer after a space."""
    if not 0 <= gold < len(choices):
        raise ConfigError(f"{task} item {index}: gold index {gold} is outside its {len(choices)} choices")
    return Item(task, index, (context,) * len(choices), tuple(" " + c for c in choices), tuple(choices), gold)


def _question(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def _last_word(task: str, index: int, context: str, word: str) -> Item:
    return Item(task, index, (context.rstrip(),), (" " + word.strip(),), (word.strip(),), 0)


def _winogrande(task: str, index: int, contexts: list[str], continuation: str, gold: int) -> Item:
    """Partial evaluation: the continuation after each filled-in context; acc_norm = acc (same continuation)."""
    cont = " " + continuation.strip()
    return Item(task, index, tuple(c.rstrip() for c in contexts), (cont,) * len(contexts), (continuation.strip(),) * len(contexts), gold)


# --------------------------------------------------------------------------- local files


def _jsonl(paths: list[Path]) -> Iterator[dict[str, Any]]:
    with paths[0].open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{paths[0]}:{n} is not a JSON object ({exc.msg})") from exc


def _hellaswag_lines(paths: list[Path]) -> Iterator[dict[str, Any]]:
    """6 lines per item: `activity_label: ctx`, gold index, 4 endings."""
    lines = paths[0].read_text(encoding="utf-8").splitlines()
    if len(lines) % 6:
        raise ConfigError(f"{paths[0]} has {len(lines)} lines, not a multiple of 6 (context, gold, 4 endings per item)")
    for start in range(0, len(lines), 6):
        ctx, gold, *endings = lines[start : start + 6]
        if not gold.strip().isdigit():
            raise ConfigError(f"{paths[0]}:{start + 2}: expected the gold index (0-3), got {gold!r}")
        yield {"ctx": ctx, "gold": int(gold), "endings": endings}


def _piqa_lines(paths: list[Path]) -> Iterator[dict[str, Any]]:
    labels = [line.strip() for line in paths[1].read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = list(_jsonl(paths[:1]))
    if len(rows) != len(labels):
        raise ConfigError(f"{paths[0]} has {len(rows)} items but {paths[1]} has {len(labels)} labels")
    for row, label in zip(rows, labels, strict=True):
        yield {**row, "label": int(label)}


# --------------------------------------------------------------------------- the eight benchmarks


def _arc_task(task: str, subset: str) -> Task:
    """ARC (Easy or Challenge): local files of lm-eval's fields, or the hub's ai2_arc rows (choices by label)."""

    def from_hub(i: int, r: dict[str, Any]) -> Item:
        labels = list(r["choices"]["label"])
        return _choice(task, i, _question(r["question"]), list(r["choices"]["text"]), labels.index(r["answerKey"]))

    return Task(
        task,
        "choice",
        "acc_norm",
        (f"benchmarks/{task}/{task}_test.jsonl",),
        _jsonl,
        ("allenai/ai2_arc", subset, "test"),
        lambda i, r: _choice(task, i, _question(r["question"]), list(r["choices"]), r["gold"]),
        from_hub,
        task,
    )


def _hub_winogrande(i: int, r: dict[str, Any]) -> Item:
    cut = r["sentence"].index("_")
    contexts = [r["sentence"][:cut] + r[f"option{k}"] for k in (1, 2)]
    return _winogrande("winogrande", i, contexts, r["sentence"][cut + 1 :], int(r["answer"]) - 1)


def _hub_hellaswag(i: int, r: dict[str, Any]) -> Item:
    ctx = hellaswag_preprocess(r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize())
    return _choice("hellaswag", i, ctx, [hellaswag_preprocess(e) for e in r["endings"]], int(r["label"]))


def _hub_obqa(i: int, r: dict[str, Any]) -> Item:
    labels = list(r["choices"]["label"])
    return _choice("openbookqa", i, r["question_stem"], list(r["choices"]["text"]), labels.index(r["answerKey"].strip()))


def _sciq_choices(r: dict[str, Any]) -> list[str]:
    return [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]]  # gold: 3, as in lm-eval


def _hub_sciq(i: int, r: dict[str, Any]) -> Item:
    """lm-evaluation-harness's sciq: the support passage (left-stripped; empty for some rows), then the question."""
    return _choice("sciq", i, f"{r['support'].lstrip()}\n{_question(r['question'])}", _sciq_choices(r), 3)


def _hub_sciq_closedbook(i: int, r: dict[str, Any]) -> Item:
    """The same questions without the support passage, as the local file has them."""
    return _choice("sciq_closedbook", i, _question(r["question"]), _sciq_choices(r), 3)


def _hub_lambada(i: int, r: dict[str, Any]) -> Item:
    context, word = r["text"].rsplit(" ", 1)
    return _last_word("lambada_openai", i, context, word)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "hellaswag",
            "choice",
            "acc_norm",
            ("benchmarks/hellaswag/hellaswag_val_full.txt",),
            _hellaswag_lines,
            ("Rowan/hellaswag", None, "validation"),
            lambda i, r: _choice(
                "hellaswag", i, hellaswag_preprocess(r["ctx"]), [hellaswag_preprocess(e) for e in r["endings"]], r["gold"]
            ),
            _hub_hellaswag,
            "hellaswag",
        ),
        Task(
            "piqa",
            "choice",
            "acc_norm",
            ("benchmarks/piqa/valid.jsonl", "benchmarks/piqa/valid-labels.lst"),
            _piqa_lines,
            ("baber/piqa", None, "validation"),
            lambda i, r: _choice("piqa", i, _question(r["goal"]), [r["sol1"], r["sol2"]], r["label"]),
            lambda i, r: _choice("piqa", i, _question(r["goal"]), [r["sol1"], r["sol2"]], int(r["label"])),
            "piqa",
        ),
        _arc_task("arc_easy", "ARC-Easy"),
        _arc_task("arc_challenge", "ARC-Challenge"),
        Task(
            "winogrande",
            "choice",
            "acc",
            ("benchmarks/winogrande/winogrande_dev.jsonl",),
            _jsonl,
            ("allenai/winogrande", "winogrande_xl", "validation"),
            lambda i, r: _winogrande("winogrande", i, list(r["context_options"]), r["continuation"], r["gold"]),
            _hub_winogrande,
            "winogrande",
        ),
        Task(
            "openbookqa",
            "choice",
            "acc_norm",
            ("benchmarks/openbookqa/openbookqa_test.jsonl",),
            _jsonl,
            ("allenai/openbookqa", "main", "test"),
            lambda i, r: _choice("openbookqa", i, r["query"], list(r["choices"]), r["gold"]),
            _hub_obqa,
            "openbookqa",
        ),
        Task(
            "sciq_closedbook",
            "choice",
            "acc_norm",
            ("benchmarks/sciq/sciq_test.jsonl",),
            _jsonl,
            ("allenai/sciq", None, "test"),
            lambda i, r: _choice("sciq_closedbook", i, _question(r["question"]), list(r["choices"]), r["gold"]),
            _hub_sciq_closedbook,
            None,
        ),
        Task(
            "sciq",
            "choice",
            "acc_norm",
            (),
            None,
            ("allenai/sciq", None, "test"),
            None,
            _hub_sciq,
            "sciq",
            not_local=(
                "sciq: the local SciQ file (benchmarks/sciq/sciq_test.jsonl) has no support passage, which lm-evaluation-harness's "
                "sciq prompt starts with; use sciq_closedbook (the same questions without it) or evaluate.source=hub for sciq"
            ),
        ),
        Task(
            "lambada_openai",
            "last_word",
            "acc",
            ("benchmarks/lambada_openai/lambada_openai_test.jsonl",),
            _jsonl,
            ("EleutherAI/lambada_openai", "default", "test"),
            lambda i, r: _last_word("lambada_openai", i, r["context"], r["continuation"]),
            _hub_lambada,
            "lambada_openai",
        ),
    )
}


def default_tasks(source: str) -> tuple[str, ...]:
    """The eight benchmarks; SciQ as `sciq_closedbook` from local files (they have no support passage), else lm-eval's `sciq`."""
    sciq = "sciq_closedbook" if source == "local" else "sciq"
    return ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "openbookqa", sciq, "lambada_openai")


def check_task_names(names: tuple[str, ...] | list[str], key: str = "evaluate.tasks") -> None:
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ConfigError(
            f"{key}: unknown task(s) {unknown}; known: {sorted(TASKS)}" if unknown else f"{key} is empty; name some of {sorted(TASKS)}"
        )


def check_source(names: tuple[str, ...] | list[str], source: str) -> None:
    """ConfigError, one line, for a task `source` cannot give: local files it has none of, an lm-eval task it has none of."""
    for name in names:
        task = TASKS[name]
        if source == "local" and not task.files:
            raise ConfigError(task.not_local or f"{name} has no local files; use evaluate.source=hub")
        if source == "lm-eval" and task.lm_eval is None:
            raise ConfigError(
                f"{name} has no lm-evaluation-harness task (lm-eval's sciq shows the support passage); "
                "with evaluate.source=lm-eval use tasks=...,sciq instead"
            )


def data_dir(path: str | Path | None) -> Path:
    """The evaluation-data folder: `path`, or <repo>/../shared/data."""
    return Path(path).expanduser() if path else DEFAULT_DATA_DIR


def task_files(task: Task, root: Path) -> list[Path]:
    """The task's files under `root`; ConfigError naming the missing file and the options to point elsewhere."""
    paths = [root / f for f in task.files]
    for path in paths:
        if not path.is_file():
            raise ConfigError(
                f"benchmark file {path} is missing ({task.name}); point evaluate.data_dir at a folder holding {task.files[0]} "
                f"(layout and sources: ../shared/data/PROVENANCE.md), or read the benchmarks from a dataset hub with evaluate.source=hub"
            )
    return paths


def _rows_local(task: Task, root: Path) -> list[dict[str, Any]]:
    check_source([task.name], "local")
    assert task.read_local is not None  # check_source: a task with files reads them
    return list(task.read_local(task_files(task, root)))


def _rows_hub(task: Task) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise ConfigError("evaluate.source=hub needs the `datasets` package: pip install datasets") from exc
    name, config, split = task.hub
    try:
        ds: Any = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        raise ConfigError(
            f"{task.name}: the dataset {name} ({config or 'default'}, {split}) could not be loaded from the hub ({exc}); "
            "use the local files with evaluate.source=local evaluate.data_dir=PATH"
        ) from exc
    return [dict(row) for row in ds]


def subset(n: int, limit: int, seed: int, task: str, exclude: tuple[tuple[int, int], ...] = ()) -> list[int]:
    """Indices of a fixed-seed subset of `limit` of `n` items (all when limit is 0 or >= n), ascending.

    `exclude`: (limit, seed) pairs of earlier subsets whose items are left out first (items seen while choosing
    defaults, so that a headline reports on items nobody tuned on); the subset is drawn from the rest.
    """
    pool = list(range(n))
    if exclude:
        seen = set().union(*(subset(n, lim, s, task) for lim, s in exclude))
        pool = [i for i in pool if i not in seen]
        if not pool:
            spent = ", ".join(f"{lim}:{s}" for lim, s in exclude)
            raise ConfigError(f"{task}: every one of its {n} items is in the excluded subsets ({spent}); drop {task} or report it apart")
    if limit <= 0 or limit >= len(pool):
        return pool
    return sorted(random.Random(f"{seed}:{task}").sample(pool, limit))


def parse_exclude(values: tuple[str, ...], key: str = "evaluate.exclude") -> tuple[tuple[int, int], ...]:
    """`("500:0", ...)` -> ((500, 0), ...): subsets given as LIMIT:SEED."""
    out = []
    for v in values:
        try:
            lim, seed = (int(x) for x in str(v).split(":"))
        except ValueError:
            raise ConfigError(f"{key} entry {v!r} is not LIMIT:SEED (e.g. 500:0)") from None
        if lim <= 0:
            raise ConfigError(f"{key} entry {v!r}: the limit must be > 0")
        out.append((lim, seed))
    return tuple(out)


def load_items(name: str, source: str, root: Path, limit: int = 0, seed: int = 0, exclude: tuple[tuple[int, int], ...] = ()) -> list[Item]:
    """Items of benchmark `name` from `source` (local | hub): all, or a fixed-seed subset of `limit` (drawn from the items
    outside the `exclude` subsets)."""
    task = TASKS[name]
    rows = _rows_local(task, root) if source == "local" else _rows_hub(task)
    convert = task.from_local if source == "local" else task.from_hub
    assert convert is not None  # _rows_local: a task with files converts its rows
    items = []
    for i in subset(len(rows), limit, seed, name, exclude):
        try:
            items.append(convert(i, rows[i]))
        except (KeyError, TypeError, ValueError) as exc:
            where = task.files[0] if source == "local" else task.hub[0]
            raise ConfigError(f"{name} item {i} of {where} does not have the expected format ({type(exc).__name__}: {exc})") from exc
    return items


def headline_metrics(names: Mapping[str, Task] | None = None) -> dict[str, str]:
    """task -> the metric the average uses."""
    return {n: t.headline for n, t in (names or TASKS).items()}
