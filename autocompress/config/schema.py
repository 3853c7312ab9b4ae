"""Typed, frozen run configuration: what Hydra composes becomes these dataclasses at the entry point.

Nothing below the entry points reads a DictConfig; Ray workers receive these objects (plain
picklable data). Every value is checked here, and a wrong one raises ConfigError naming its key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from autocompress.config.deployment import (  # noqa: F401  (re-exported: the deployment half of a run's spec)
    DTYPE_BYTES,
    VLLM_CPU_KV_DTYPES,
    VLLM_KV_DTYPES,
    Hardware,
    Scenario,
    Workload,
    vllm_kv_cache_dtype,
)
from autocompress.config.metrics import METRICS
from autocompress.config.ranges import positive as _positive
from autocompress.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """The base model: the embedded SmolLM2 GGUF, a Hugging Face path or hub id, a tiny random Llama, or the tiny hybrid MoE."""

    name: str
    source: Literal["smollm2_gguf", "hf", "tiny", "tiny_hybrid_moe"]
    path: str | None = None  # hf: local directory or hub id
    num_layers: int = 4  # tiny only
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 256
    seed: int = 0
    train_steps: int | None = None  # tiny_hybrid_moe: training steps (None: the recipe's, autocompress.model.tiny_moe)

    def __post_init__(self) -> None:
        if self.source not in ("smollm2_gguf", "hf", "tiny", "tiny_hybrid_moe"):
            raise ConfigError(f"model.source={self.source!r} is unknown; use smollm2_gguf, hf, tiny or tiny_hybrid_moe")
        if self.train_steps is not None and (isinstance(self.train_steps, bool) or self.train_steps < 1):
            raise ConfigError(f"model.train_steps={self.train_steps!r} must be a whole number >= 1 (or null for the recipe's)")
        if self.source == "hf" and not self.path:
            raise ConfigError("model.path is required when model.source=hf (a local directory or hub id)")
        if self.source == "tiny":  # the shapes the tiny Llama is built with (other sources read their own)
            for key in ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
                _positive(f"model.{key}", getattr(self, key))
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"model.num_attention_heads={self.num_attention_heads} does not divide model.hidden_size={self.hidden_size}; "
                    "choose a head count that does"
                )
            if self.num_attention_heads % self.num_key_value_heads:
                raise ConfigError(
                    f"model.num_key_value_heads={self.num_key_value_heads} does not divide model.num_attention_heads="
                    f"{self.num_attention_heads}; every KV head serves the same number of query heads"
                )
            if (self.hidden_size // self.num_attention_heads) % 2:
                raise ConfigError(
                    f"model.hidden_size={self.hidden_size} / model.num_attention_heads={self.num_attention_heads} = "
                    f"{self.hidden_size // self.num_attention_heads} is odd; rotary embeddings rotate pairs: choose an even head size"
                )


@dataclass(frozen=True)
class SpaceSpec:
    """Which architectures the search may pick (nemotron-nas block_configs form)."""

    hidden_divisor: int = 64
    min_hidden_fraction: float = 0.5
    ffn_divisor: int = 128
    min_ffn_fraction: float = 0.125
    allow_attention_noop: bool = True
    allow_ffn_noop: bool = True
    query_heads: bool = True  # search the global query-head count (whole heads per KV group, as Minitron prunes)

    def __post_init__(self) -> None:
        _positive("search.space.hidden_divisor", self.hidden_divisor)
        _positive("search.space.ffn_divisor", self.ffn_divisor)
        for key in ("min_hidden_fraction", "min_ffn_fraction"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ConfigError(f"search.space.{key} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class DataSpec:
    """Calibration text, split by document into calibration / selection / report windows (see autocompress.model.data)."""

    source: Literal["stdlib", "text", "jsonl", "hf"] = "stdlib"
    path: str | None = None  # text: file or folder; jsonl: file or folder of *.jsonl; hf: dataset name or local path
    field: str = "text"  # jsonl / hf: the text column
    hf_config: str | None = None
    hf_split: str = "train"
    seq_len: int = 128
    calib_sequences: int = 48  # importance ranking and the search's distillation loss
    select_sequences: int = 32  # choosing among candidates: Pareto front, Optuna objective, compare's pick, Minitron's top-k
    report_sequences: int = 32  # every KL / perplexity printed or compared
    select_share: float = 0.1  # share of the documents reserved for the selection split
    report_share: float = 0.1  # share reserved for the report split; calibration gets the rest
    test_share: float = 0.1  # share held out for the headline's test split (from the end of calibration's document order)
    test_sequences: int = 64  # test-split windows (read by benchmarks/headline.py only)
    windows_per_document: int = 4  # most windows one document gives a split (one each first, more only when documents run out)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source not in ("stdlib", "text", "jsonl", "hf"):
            raise ConfigError(f"data.source={self.source!r} is unknown; use stdlib, text, jsonl or hf")
        if self.source != "stdlib" and not self.path:
            raise ConfigError(f"data.path is required when data.source={self.source}")
        for key in ("seq_len", "calib_sequences", "select_sequences", "report_sequences", "test_sequences", "windows_per_document"):
            _positive(f"data.{key}", getattr(self, key))
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len={self.seq_len}: a window needs >= 2 tokens (each predicts the next); choose 2 or more")
        for key in ("select_share", "report_share"):
            if not 0 < getattr(self, key) < 1:
                raise ConfigError(f"data.{key} must be in (0, 1), got {getattr(self, key)!r}")
        if not 0 <= self.test_share < 1:
            raise ConfigError(f"data.test_share must be in [0, 1), got {self.test_share!r}")
        if self.select_share + self.report_share + self.test_share >= 1:
            raise ConfigError(
                f"data.select_share + data.report_share (+ data.test_share) = "
                f"{self.select_share + self.report_share + self.test_share:g} leaves no calibration "
                "documents; keep their sum below 1"
            )


@dataclass(frozen=True)
class LagrangianSettings:
    """The knobs Ray Tune sweeps: each setting lands on a different quality/cost trade-off."""

    lambda_init: float = 1.0  # initial multiplier of every constraint
    dual_lr: float = 0.5  # dual-ascent step on lambda; 0 = fixed weights (plain penalty)
    margin: float = 0.0  # tighten every bound by this share (0.1 = aim 10% inside)
    quadratic: float = 0.0  # weight of an extra 0.5 * rho * max(g, 0)^2 term
    tau_start: float = 1.0  # Gumbel-softmax temperature, annealed geometrically
    tau_end: float = 0.1
    lr: float = 0.3  # Adam step on the architecture logits
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("lambda_init", "dual_lr", "quadratic"):
            _positive(f"search.settings.{key}", getattr(self, key), allow_zero=True)
        for key in ("tau_start", "tau_end", "lr"):
            _positive(f"search.settings.{key}", getattr(self, key))
        if not 0 <= self.margin < 1:
            raise ConfigError(f"search.settings.margin must be in [0, 1), got {self.margin!r}")


SETTING_KEYS = [f.name for f in fields(LagrangianSettings)]


def _check_grid(grid: Mapping[str, Any]) -> None:
    """Every grid value is a valid Lagrangian setting (a margin of 1.5 is refused now, not in every trial)."""
    for key, values in grid.items():
        for value in values if isinstance(values, list | tuple) else [values]:
            _check_setting(f"sweep.definition.grid.{key}", key, value)


def _check_space(space: Mapping[str, Any]) -> None:
    """Every Optuna range is {low, high[, log]} of valid Lagrangian settings, low < high (log: low > 0)."""
    for key, dist in space.items():
        where = f"sweep.definition.space.{key}"
        if not isinstance(dist, Mapping) or set(dist) - {"low", "high", "log"} or not {"low", "high"} <= set(dist):
            raise ConfigError(f"{where} must be {{low: NUM, high: NUM}} (optionally log: true), got {dist!r}")
        for end in ("low", "high"):
            _check_setting(f"{where}.{end}", key, dist[end])
        if not dist["low"] < dist["high"] or (dist.get("log") and dist["low"] <= 0):
            raise ConfigError(f"{where}: low={dist['low']!r} must be below high={dist['high']!r} (and > 0 with log: true)")


def _check_setting(where: str, key: str, value: Any) -> None:
    """`value` as search.settings.`key`, checked as the search's config is (type and documented range)."""
    from autocompress.config.build import build  # build imports this module

    try:
        build(LagrangianSettings, {key: value}, "search.settings")
    except ConfigError as exc:
        raise ConfigError(f"{where} holds {value!r}: {exc}") from None


@dataclass(frozen=True)
class SearchSpec:
    """One differentiable search run: budget and batch shape."""

    steps: int = 96  # as conf/search/default.yaml (every command composes that file)
    batch_size: int = 2  # sequences per step
    importance_sequences: int = 8  # calibration sequences for the importance ranking
    init_bias: float = 2.0  # initial logit advantage of the starting option
    start: str = "base"  # where the distributions start: "base" (the unpruned model) | "rival" (the homogeneous rival)
    straight_through: bool = False  # hard one-hot samples forward (else relaxed mixtures)
    settle_steps: int = 0  # at most this many extra steps while the argmax misses a bound (multipliers follow its violation)
    settle_lr: float = 1.0  # the logits' step while settling, as a fraction of search.settings.lr (< 1: fewer decisions flip per step)
    probe_sequences: int = 1  # calibration sequences that measure each repair / fill candidate
    candidates: int = 8  # repair / fill moves measured per step (the search's distributions rank them)
    fill: bool = True  # after repair, spend the slack left inside the margin-tightened bounds
    homogeneous_candidate: bool = True  # the best full-width homogeneous architecture (filled alike) competes with each search's result
    threads: int = 0  # torch threads per search; 0 = the CPUs Ray gives the trial
    space: SpaceSpec = field(default_factory=SpaceSpec)
    settings: LagrangianSettings = field(default_factory=LagrangianSettings)

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "importance_sequences", "probe_sequences", "candidates"):
            _positive(f"search.{key}", getattr(self, key))
        _positive("search.threads", self.threads, allow_zero=True)
        _positive("search.settle_steps", self.settle_steps, allow_zero=True)
        if not 0 < self.settle_lr <= 1:
            raise ConfigError(f"search.settle_lr must be in (0, 1] (a fraction of search.settings.lr), got {self.settle_lr!r}")
        if self.start not in ("base", "rival"):
            raise ConfigError(f"search.start={self.start!r} is unknown; use base (the unpruned model) or rival (the homogeneous rival)")


TRACKERS = ("mlflow", "wandb")  # sweep.tracking: Ray Tune logger callbacks a sweep can send its trials to


@dataclass(frozen=True)
class SweepSpec:
    """How Ray Tune runs the searches."""

    # What the trials vary: the sweep/definition config group (conf/sweep/definition/), e.g.
    # {searcher: grid, grid: {margin: [...]}} or {searcher: optuna, space: {margin: {low, high}}}.
    definition: Mapping[str, Any]
    num_trials: int = 8
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0  # GPUs Ray reserves for each trial
    memory_per_trial_gib: float | None = None  # Ray `memory` each trial reserves (None = none)
    pending_warn_s: float = 60.0  # warn when trials stay pending this long with none running
    pending_timeout_s: float | None = 1800.0  # then give up (None = wait for the cluster forever)
    max_concurrent_trials: int = 0  # 0 = as many as the cluster fits
    max_failures: int = 1  # retries of an errored trial
    ray_address: str | None = None  # None = start local Ray; "auto" or host:port = join a cluster
    objective_cost: str = "tpot_ms"  # cost a multi-objective searcher trades against quality
    storage_path: str | None = None  # Ray Tune's storage: None = the run folder; an absolute shared path or s3:// gs:// URI
    optuna_storage: str | None = None  # None = a journal file in the run folder; or an Optuna storage URL
    report_every: int = 1  # a trial reports its search's step record to Ray Tune every N steps (0 = the final row only)
    tracking: tuple[str, ...] = ()  # also log every trial to: mlflow, wandb (Ray Tune's logger callbacks)
    tracking_uri: str | None = None  # MLflow's tracking URI (None = sqlite:///<run folder>/mlflow.db)

    def __post_init__(self) -> None:
        if not isinstance(self.definition, Mapping):
            got = self.definition
            raise ConfigError(f"sweep.definition must be a mapping, got {got!r}; choose one with sweep/definition=NAME")
        searcher = self.definition.get("searcher")
        if searcher not in ("grid", "optuna"):
            raise ConfigError(f"sweep.definition.searcher must be grid or optuna, got {searcher!r}; choose one with sweep/definition=NAME")
        params = self.definition.get("grid" if searcher == "grid" else "space") or {}
        unknown = sorted(set(params) - set(SETTING_KEYS))
        if unknown or not params:
            kind = "grid" if searcher == "grid" else "space"
            raise ConfigError(
                f"sweep.definition.{kind} must vary at least one Lagrangian setting; unknown: {unknown}; known: {SETTING_KEYS}"
            )
        if searcher == "grid":
            _check_grid(params)
        else:
            _check_space(params)
        _positive("sweep.num_trials", self.num_trials)
        _positive("sweep.cpus_per_trial", self.cpus_per_trial)
        _positive("sweep.gpus_per_trial", self.gpus_per_trial, allow_zero=True)
        if self.memory_per_trial_gib is not None:
            _positive("sweep.memory_per_trial_gib", self.memory_per_trial_gib)
        _positive("sweep.pending_warn_s", self.pending_warn_s)
        if self.pending_timeout_s is not None:
            _positive("sweep.pending_timeout_s", self.pending_timeout_s)
        _positive("sweep.max_concurrent_trials", self.max_concurrent_trials, allow_zero=True)
        _positive("sweep.max_failures", self.max_failures, allow_zero=True)
        if self.objective_cost not in METRICS:
            raise ConfigError(f"sweep.objective_cost={self.objective_cost!r}; use one of {sorted(METRICS)}")
        unknown_tracking = sorted(set(self.tracking) - set(TRACKERS))
        if unknown_tracking:
            raise ConfigError(
                f"sweep.tracking holds {unknown_tracking[0]!r}; use a list of {', '.join(TRACKERS)} (e.g. sweep.tracking=[mlflow])"
            )
        path = self.storage_path
        if path is not None and not (re.match(r"^[a-z][a-z0-9+.-]*://.", path) or path.startswith("/")):
            raise ConfigError(
                f"sweep.storage_path={path!r} must be an absolute path that every node shares (e.g. an NFS mount) "
                "or a URI (s3://bucket/prefix, gs://bucket/prefix); drop it to keep Ray Tune's files in the run folder"
            )


@dataclass(frozen=True)
class ProfileSpec:
    """Engine profiling: which architectures and workloads are measured, and how."""

    measure: bool = True
    fit: bool = True
    n_random: int = 12
    holdout_share: float = 0.34
    uniform_fractions: tuple[float, ...] = (0.35, 0.6, 0.8)
    extra_workloads: tuple[str, ...] = ()
    kv_cache_gib: float | None = None
    repeats: int = 7
    warmup: int = 1
    timeout_s: float = 900.0
    enforce_eager: bool = False  # serve without torch.compile (what verify and the fitted model then describe)
    single_process: bool = False  # engine core and worker in the measuring process: ~30 s less per engine start, no IPC hops timed
    seed: int = 0
    source: str = "engine"  # engine: measure in the serving engine here | aiconfigurator: NVIDIA's kernel-table estimates (GPUs)

    def __post_init__(self) -> None:
        _positive("profile.repeats", self.repeats)
        _positive("profile.warmup", self.warmup, allow_zero=True)
        _positive("profile.n_random", self.n_random, allow_zero=True)
        _positive("profile.timeout_s", self.timeout_s)
        if self.kv_cache_gib is not None:
            _positive("profile.kv_cache_gib", self.kv_cache_gib)
        if self.source not in ("engine", "aiconfigurator"):
            raise ConfigError(f"profile.source must be engine or aiconfigurator, got {self.source!r}")
        if not 0 <= self.holdout_share < 1:
            raise ConfigError(f"profile.holdout_share must be in [0, 1), got {self.holdout_share!r}")
        if any(not 0 < f < 1 for f in self.uniform_fractions):
            raise ConfigError(f"profile.uniform_fractions must lie in (0, 1), got {list(self.uniform_fractions)}")


@dataclass(frozen=True)
class RunSpec:
    """Everything one sweep needs, resolved from the composed config."""

    scenario: Scenario
    model: ModelSpec
    data: DataSpec
    search: SearchSpec
    sweep: SweepSpec
    results_dir: str = "results"
    run_id: str | None = None
    profile: ProfileSpec = field(default_factory=ProfileSpec)
    cost_model: str = "auto"  # auto (fitted for this hardware if any, else analytic) | analytic | path of a fitted model
