"""What `compare` compares and how: its settings, one row per model, the paired bootstrap over items and seeds, the table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from autocompress.baselines.interface import BASELINES, NaiveSpec
from autocompress.baselines.minitron import MinitronSpec
from autocompress.baselines.puzzletron import PuzzletronSpec
from autocompress.config.build import build, run_spec_from_dict
from autocompress.config.metrics import METRICS, Constraint
from autocompress.config.schema import RunSpec
from autocompress.errors import ConfigError
from autocompress.quality.distillation import DistillSpec
from autocompress.quality.evaluation import EvalResult, EvalSpec
from autocompress.quality.probe import ProbeSpec
from autocompress.quality.tasks import TASKS

COSTS = tuple(METRICS)  # every constrained cost, in the one metric table's order
DEFAULT_METHODS = ("autocompress", "minitron", "puzzletron")


def known_methods() -> tuple[str, ...]:
    """What compare.methods may name: AutoCompress and every baseline registered in BASELINES (read when asked)."""
    return ("autocompress", *BASELINES)


def title(method: str) -> str:
    """A method's name in tables."""
    return "AutoCompress" if method == "autocompress" else BASELINES[method].title if method in BASELINES else method


def llama_only(method: str) -> bool:
    """Left out of a hybrid-MoE run's default methods, refused when named there."""
    return method in BASELINES and BASELINES[method].llama_only


@dataclass(frozen=True)
class CompareSpec:
    """What to compare and where (conf/compare/default.yaml)."""

    run: str | None = None  # a finished sweep run folder; None = run the sweep first
    trial: str | None = None  # the AutoCompress trial; None = the best feasible by selection-split KL
    out: str | None = None  # None = <run>/compare
    measure: str = "auto"  # measured costs: auto (when this machine is the scenario's hardware) | always | never
    bootstrap: int = 2000  # paired bootstrap resamples of the benchmark items (and seeds)
    seed: int = 0
    seeds: tuple[int, ...] = (0, 1)  # distillation seeds per model: the interval covers seed variation
    methods: tuple[str, ...] | None = None  # None: autocompress, minitron and (Llama family) puzzletron
    minitron: MinitronSpec = field(default_factory=MinitronSpec.tuned)  # tuned with ModelOpt's own knobs
    minitron_default: MinitronSpec = field(default_factory=MinitronSpec)  # ModelOpt's defaults (widened only if nothing fits)
    puzzletron: PuzzletronSpec = field(default_factory=PuzzletronSpec)
    homogeneous: NaiveSpec = field(default_factory=NaiveSpec)
    greedy: NaiveSpec = field(default_factory=NaiveSpec)
    probe: ProbeSpec = field(default_factory=ProbeSpec)  # pick each method's final candidate after a short distillation
    test_split: bool = False  # the held-out test split (data.test_share): KL and perplexity of every distilled model (the headline's)
    runner_up: bool = False  # each method's runner-up by its own selection score, distilled and scored alike (pick noise; the headline's)
    # the settings of registered baselines that have no field above (Baseline.settings), by name: compare.<name>
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        for key in ("run", "trial", "out"):  # an empty value is a mistake, not "not given" (run= would start a whole sweep)
            value = getattr(self, key)
            if value is not None and not str(value).strip():
                raise ConfigError(f"compare.{key} is empty; give a value or leave it out (null: {CompareSpec.DEFAULTS[key]})")
        if self.methods is not None:
            methods = tuple(str(m) for m in self.methods)
            object.__setattr__(self, "methods", methods)
            unknown = [m for m in methods if m not in known_methods()]
            if unknown:
                raise ConfigError(f"compare.methods names {unknown}; known methods: {list(known_methods())}")
            if not methods or methods[0] != "autocompress" or len(set(methods)) != len(methods) or len(methods) < 2:
                raise ConfigError(
                    f"compare.methods={list(methods)}: start with autocompress and name each baseline once, "
                    "e.g. [autocompress, minitron, puzzletron]"
                )
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"compare.seeds must be a non-empty list of distinct seeds, got {list(self.seeds)!r}")
        if self.measure not in ("auto", "always", "never"):
            raise ConfigError(f"compare.measure={self.measure!r} is unknown; use auto, always or never")
        if self.bootstrap < 100:
            raise ConfigError(f"compare.bootstrap must be >= 100, got {self.bootstrap!r}")

    DEFAULTS: ClassVar[dict[str, str]] = {"run": "run the sweep first", "trial": "the best feasible trial", "out": "<run>/compare"}

    def resolved_methods(self, hybrid: bool) -> tuple[str, ...]:
        """The methods of a run of this family: the default drops the Llama-only ones for a hybrid-MoE run, where naming
        one is refused."""
        if self.methods is None:
            return tuple(m for m in DEFAULT_METHODS if not (hybrid and llama_only(m)))
        wrong = [m for m in self.methods if hybrid and llama_only(m)]
        if wrong:
            raise ConfigError(f"compare.methods: {', '.join(wrong)} prune(s) Llama-family models only; drop it for a hybrid-MoE run")
        return self.methods

    def settings_of(self, method: str) -> Any:
        """A baseline's settings: CompareSpec's field of its name, else compare.<name> built as its Baseline.settings."""
        if method in {f.name for f in fields(self)}:
            return getattr(self, method)
        if method in self.extra:
            return self.extra[method]
        baseline = BASELINES[method]
        return baseline.settings() if baseline.settings is not None else None


@dataclass(frozen=True)
class CompareJob:
    spec: RunSpec
    compare: CompareSpec
    distill: DistillSpec
    evaluate: EvalSpec


def compare_spec(data: Mapping[str, Any]) -> CompareSpec:
    """compare.* as CompareSpec; compare.<name> of a registered baseline without a field of its own is built as that
    baseline's settings class (Baseline.settings) into CompareSpec.extra."""
    data = dict(data)
    own = {f.name for f in fields(CompareSpec)} - {"extra"}
    extra: dict[str, Any] = {
        name: build(b.settings, data.pop(name) or {}, f"compare.{name}")
        for name, b in BASELINES.items()
        if name not in own and b.settings is not None and name in data
    }
    if "extra" in data:
        raise ConfigError("compare.extra is not a setting: give a baseline's settings as compare.<name>")
    return replace(build(CompareSpec, data, "compare"), extra=extra)


def job_from_dict(cfg: dict[str, Any]) -> CompareJob:
    return CompareJob(
        spec=run_spec_from_dict(cfg),
        compare=compare_spec(cfg.get("compare") or {}),
        distill=build(DistillSpec, cfg.get("distill") or {}, "distill"),
        evaluate=build(EvalSpec, cfg.get("evaluate") or {}, "evaluate"),
    )


# --------------------------------------------------------------------------- statistics


def _correct(runs: list[pd.DataFrame], task: str, index: pd.Index) -> np.ndarray:
    """[seeds, items] headline correctness of `task`'s items in `index` order, one row per seed's evaluation."""
    return np.stack([r[r["task"] == task].set_index("index").loc[index, "correct"].to_numpy(dtype=float) for r in runs])


def paired_bootstrap(
    a: pd.DataFrame | list[pd.DataFrame], b: pd.DataFrame | list[pd.DataFrame], n: int = 2000, seed: int = 0
) -> pd.DataFrame:
    """Per benchmark and for the average over benchmarks: mean(a - b) of the headline metric (`correct`), in points.

    `a` and `b` are items tables, or one per distillation seed. The point estimate averages over
    seeds; the 95% percentile interval resamples the items within each benchmark (the same items
    for a and b) and, per resample, each model's seeds with replacement (the same draw for every
    benchmark) and averages over them as the point estimate does, so it covers seed variation as
    well as item sampling.
    """
    runs_a, runs_b = (x if isinstance(x, list) else [x] for x in (a, b))
    rng = np.random.default_rng(seed)
    pick_a = rng.integers(0, len(runs_a), size=(n, len(runs_a)))  # [n, Sa]: the seeds of each resample, drawn with replacement
    pick_b = rng.integers(0, len(runs_b), size=(n, len(runs_b)))  # [n, Sb]
    rows, boots = [], []
    for task in dict.fromkeys(runs_a[0]["task"]):
        index = pd.Index(sorted(set.intersection(*(set(r.loc[r["task"] == task, "index"]) for r in [*runs_a, *runs_b]))))
        if index.empty:
            continue
        ca, cb = _correct(runs_a, task, index) * 100, _correct(runs_b, task, index) * 100  # [Sa, m], [Sb, m]
        items = rng.integers(0, len(index), size=(n, len(index)))  # [n, m]
        boot = ca[pick_a[:, :, None], items[:, None, :]].mean(axis=(1, 2)) - cb[pick_b[:, :, None], items[:, None, :]].mean(axis=(1, 2))
        boots.append(boot)
        rows.append(
            {
                "task": task,
                "diff": float(ca.mean() - cb.mean()),
                "lo": float(np.percentile(boot, 2.5)),
                "hi": float(np.percentile(boot, 97.5)),
                "n": len(index),
            }
        )
    if boots:
        avg = np.mean(boots, axis=0)
        point = float(np.mean([r["diff"] for r in rows]))
        rows.append(
            {
                "task": "average",
                "diff": point,
                "lo": float(np.percentile(avg, 2.5)),
                "hi": float(np.percentile(avg, 97.5)),
                "n": sum(r["n"] for r in rows),
            }
        )
    return pd.DataFrame(rows, columns=["task", "diff", "lo", "hi", "n"])


@dataclass
class Model:
    """One row of the comparison: an architecture and what each stage produced for it."""

    name: str
    arch: Any  # Architecture
    costs: dict[str, float]
    kl: float  # report-split KL before distillation
    label: str = ""  # trial id / candidate
    distill: list[dict[str, Any]] = field(default_factory=list)  # distill.json per seed
    results: list[EvalResult] = field(default_factory=list)  # evaluation per seed (one for the unpruned model)
    measured: dict[str, float] = field(default_factory=dict)
    test: list[dict[str, float]] = field(default_factory=list)  # test-split KL and perplexity per seed (compare.test_split)
    source: str = ""  # which pick made its checkpoint (a baseline's pick-stage key, hashed): in its seed stages' keys

    def student(self) -> dict[str, str]:
        """What a seed's stages know the pruned checkpoint by: its shape, and the pick that made it where it says."""
        return {"student": self.arch.to_json(), **({"source": self.source} if self.source else {})}

    def test_mean(self, key: str) -> float:
        return float(np.mean([t[key] for t in self.test])) if self.test else float("nan")

    def score(self, task: str, metric: str | None = None) -> float:
        """Mean over seeds."""
        return float(np.mean([r.score(task, metric) for r in self.results]))


# --------------------------------------------------------------------------- the table


def model_row(m: Model, constraints: tuple[Constraint, ...]) -> dict[str, Any]:
    row: dict[str, Any] = {"model": m.name, "label": m.label, "params": m.arch.num_params(), "heterogeneous": not m.arch.is_homogeneous()}
    row |= {c: m.costs[c] for c in COSTS}
    row |= {f"measured_{k}": v for k, v in m.measured.items()}
    row["feasible"] = all(c.satisfied(m.costs[c.metric]) for c in constraints)
    row["kl_pruned"] = m.kl
    row["kl_distilled"] = float(np.mean([d["kl_after"] for d in m.distill])) if m.distill else (0.0 if m.name == "base" else float("nan"))
    row["seeds"] = len(m.results)
    first = m.results[0].scores
    for task in first.loc[first["headline"], "task"]:
        row[task] = 100 * m.score(task)
    row["lambada_ppl"] = m.score("lambada_openai", "perplexity")
    row["corpus_ppl"] = m.score("corpus", "perplexity")
    if m.test:
        row["test_kl"], row["test_ppl"] = m.test_mean("kl"), m.test_mean("perplexity")
    return row


def markdown(frame: pd.DataFrame, diffs: dict[str, pd.DataFrame], constraints: tuple[Constraint, ...], note: str, job: CompareJob) -> str:
    bounds = "; ".join(c.describe() for c in constraints)
    tasks = [t for t in TASKS if t in frame.columns]
    cost_cols = [c for c in COSTS if any(k.metric == c for k in constraints)]
    head = [
        "model",
        "params (M)",
        *cost_cols,
        *[f"measured {c}" for c in cost_cols if f"measured_{c}" in frame],
        "feasible",
        "KL pruned",
        "KL distilled",
        *tasks,
        "average",
        "LAMBADA ppl",
        "corpus ppl",
    ]
    lines = [f"constraint: {bounds} (absolute, as the sweep resolved them); costs predicted by the same cost model; {note}", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in frame.iterrows():
        cells = [f"{r['model']}", f"{r['params'] / 1e6:.1f}", *[f"{r[c]:.4g}" for c in cost_cols]]
        cells += [f"{r[f'measured_{c}']:.4g}" for c in cost_cols if f"measured_{c}" in frame]
        cells += ["yes" if r["feasible"] else "NO", f"{r['kl_pruned']:.4f}", f"{r['kl_distilled']:.4f}"]
        cells += [f"{r[t]:.2f}" for t in tasks] + [f"{r['average']:.2f}", f"{r['lambada_ppl']:.2f}", f"{r['corpus_ppl']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for method, diff in diffs.items():
        cells = [
            f"AutoCompress - {title(method)} (95% CI)",
            "",
            *[""] * len(cost_cols),
            *["" for c in cost_cols if f"measured_{c}" in frame],
            "",
            "",
            "",
        ]
        by_task = diff.set_index("task")
        cells += [f"{by_task.loc[t, 'diff']:+.2f} [{by_task.loc[t, 'lo']:+.2f}, {by_task.loc[t, 'hi']:+.2f}]" for t in [*tasks, "average"]]
        lines.append("| " + " | ".join([*cells, "", ""]) + " |")
    ev, d = job.evaluate, job.distill
    lines += [
        "",
        f"Benchmarks: headline metric in points (acc_norm; acc for WinoGrande and LAMBADA), {ev.limit or 'all'} items per benchmark "
        f"(seed {ev.seed}), means over distillation seeds {list(job.compare.seeds)}; paired bootstrap over items and seeds, "
        f"{job.compare.bootstrap} resamples. Distillation per seed: {d.steps} steps x {d.batch_size} x {d.seq_len} tokens "
        f"({d.steps * d.batch_size * d.seq_len:,} tokens) of calibration text, lr {d.lr:g}. KL pruned: report split, before distillation.",
    ]
    probe = job.compare.probe
    if probe.on:
        lines[-1] += (
            f" Picks: each method's {probe.candidates} best by selection-split KL, distilled {probe.tokens:,} tokens each, the lowest "
            "selection-split KL after it kept (compare.probe; candidates in compare.json)."
        )
    return "\n".join(lines) + "\n"
