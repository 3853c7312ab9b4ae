"""The valid range of every numeric setting, in one table.

`build` checks each number a command reads against it after the dataclass's own checks (which stay for objects made in
code), so a value outside its range is one ConfigError naming the key; docs/configuration.md prints the same ranges, and
tests/test_config_ranges.py keeps the table, the checks and the doc in step. Keyed by the settings dataclass (its name,
so this module imports none of them) and field; a tuple field's range holds for each element.

Upper bounds keep a value a command can still run with: seeds fit NumPy's and Optuna's 32-bit seeds, thread counts
torch's C int, seconds threading's TIMEOUT_MAX, hardware terms the bounds the cost-model fit works within
(autocompress.cost.fitted.UPPER), and counts stay finite in the float arithmetic that follows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autocompress.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """[low, high], either end open; `also`: single values allowed outside it (0 = off)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, ...] = ()
    why: str = ""  # appended to the refusal: why the range is what it is, or what to do

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        if value in self.also:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        interval = f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"
        return " or ".join([*(_num(a) for a in self.also), interval])

    def refusal(self, key: str, value: Any) -> str:
        return f"{key} must be {'' if self.also else 'in '}{self}, got {value!r}{'; ' + self.why if self.why else ''}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


MANY = 10**6  # most sequences, steps, trials, ... a setting may ask for
SEED = Range(0, 2**32 - 1, why="NumPy and Optuna take seeds in [0, 2^32)")
THREADS = Range(0, 1024, why="0 = the default count")
SECONDS = Range(0, 1e9, low_open=True)  # below threading.TIMEOUT_MAX
SHARE = Range(0, 1, low_open=True)  # (0, 1]: a share of a peak or of a capacity
COUNT = Range(1, MANY)
COUNT0 = Range(0, MANY)
TOKENS = Range(1, 10**12)
WEIGHT = Range(0, 1e6)  # a non-negative weight or term
POSITIVE = Range(0, 1e6, low_open=True)

RANGES: dict[str, dict[str, Range]] = {
    "Hardware": {
        "peak_tflops": POSITIVE,
        "mem_bandwidth_gbs": POSITIVE,
        "memory_gib": POSITIVE,
        "eta_compute": SHARE,
        "eta_memory": SHARE,
        "step_overhead_ms": Range(0, 1e4),
        "block_overhead_us": Range(0, 1e6),
        "memory_overhead_gib": WEIGHT,
        "memory_utilization": SHARE,
        "max_num_batched_tokens": Range(1, 10**8),
        "kv_cache_gib": POSITIVE,
        "prefill_eta_compute": SHARE,
        "prefill_overhead_ms": Range(0, 1e5),
        "prefill_block_overhead_us": Range(0, 1e6),
        "prefill_attn_eta": SHARE,
        "gemm_half_rows": Range(0, 1e4),
    },
    "Workload": {
        "prompt_len": Range(1, 10**8),
        "output_len": Range(1, 10**8),
        "concurrency": Range(1, MANY),
        "context_len": Range(1, 10**8),
    },
    "ModelSpec": {
        "num_layers": Range(1, 1024),
        "hidden_size": Range(1, 65536),
        "intermediate_size": Range(1, 262144),
        "num_attention_heads": Range(1, 1024),
        "num_key_value_heads": Range(1, 1024),
        "vocab_size": Range(256, MANY, why="the tiny model's byte-level tokenizer emits ids 0-255"),
        "seed": SEED,
        "train_steps": COUNT,
    },
    "SpaceSpec": {
        "hidden_divisor": Range(1, 65536),
        "min_hidden_fraction": SHARE,
        "ffn_divisor": Range(1, 262144),
        "min_ffn_fraction": SHARE,
    },
    "DataSpec": {
        "seq_len": Range(2, MANY),
        "calib_sequences": COUNT,
        "select_sequences": COUNT,
        "report_sequences": COUNT,
        "select_share": Range(0, 1, low_open=True, high_open=True),
        "report_share": Range(0, 1, low_open=True, high_open=True),
        "test_share": Range(0, 1, high_open=True),
        "test_sequences": COUNT,
        "windows_per_document": COUNT,
        "seed": SEED,
    },
    "LagrangianSettings": {
        "lambda_init": Range(0, 1e3),
        "dual_lr": Range(0, 1e3),
        "margin": Range(0, 1, high_open=True),
        "quadratic": Range(0, 1e3),
        "tau_start": Range(0, 1e3, low_open=True),
        "tau_end": Range(0, 1e3, low_open=True),
        "lr": Range(0, 1e3, low_open=True),
        "seed": SEED,
    },
    "SearchSpec": {
        "steps": COUNT,
        "batch_size": COUNT,
        "importance_sequences": COUNT,
        "init_bias": Range(0, 100, why="a logit advantage; larger saturates the softmax"),
        "settle_steps": COUNT0,
        "settle_lr": SHARE,
        "probe_sequences": COUNT,
        "candidates": COUNT,
        "threads": THREADS,
    },
    "SweepSpec": {
        "num_trials": COUNT,
        "cpus_per_trial": Range(1e-4, 1e6, why="Ray counts resources in steps of 0.0001"),
        "gpus_per_trial": Range(1e-4, 1e6, also=(0,), why="Ray counts resources in steps of 0.0001"),
        "memory_per_trial_gib": POSITIVE,
        "pending_warn_s": SECONDS,
        "pending_timeout_s": SECONDS,
        "max_concurrent_trials": COUNT0,
        "max_failures": COUNT0,
        "report_every": COUNT0,
    },
    "ProfileSpec": {
        "n_random": COUNT0,
        "holdout_share": Range(0, 1, high_open=True),
        "uniform_fractions": Range(0, 1, low_open=True, high_open=True),
        "kv_cache_gib": POSITIVE,
        "repeats": COUNT,
        "warmup": COUNT0,
        "timeout_s": SECONDS,
        "seed": SEED,
    },
    "DistillSpec": {
        "tokens": TOKENS,
        "seq_len": Range(2, MANY, why="a window needs >= 2 tokens (each predicts the next)"),
        "batch_size": COUNT,
        "lr": Range(0, 1, low_open=True),
        "min_lr_ratio": Range(0, 1),
        "warmup_steps": COUNT0,
        "weight_decay": Range(0, 100),
        "grad_clip": WEIGHT,
        "temperature": Range(0, 100, low_open=True),
        "hidden_weight": WEIGHT,
        "save_every": COUNT,
        "eval_sequences": COUNT,
        "threads": THREADS,
        "seed": SEED,
    },
    "EvalSpec": {
        "limit": COUNT0,
        "seed": SEED,
        "corpus_seq_len": Range(2, MANY, why="a window scores every token after its first"),
        "corpus_windows": COUNT0,
        "batch_tokens": Range(1, 10**9),
        "max_length": Range(1, 10**8),
        "threads": THREADS,
    },
    "CompareSpec": {
        "bootstrap": Range(100, MANY),
        "seed": SEED,
        "seeds": SEED,
    },
    "MinitronSpec": {
        "top_k": COUNT,
        "max_width_pruning": Range(0, 1, high_open=True),
        "max_depth_pruning": Range(0, 1, high_open=True),
        "layers_divisor": Range(1, 1024),
        "importance_sequences": COUNT,
        "score_sequences": COUNT,
        "budget": COUNT,
    },
    "PuzzletronSpec": {
        "score_sequences": COUNT,
        "batch_size": COUNT,
        "max_solves": Range(1, 1000),
        "time_limit": SECONDS,
        "choices": Range(1, 1000),
    },
    "NaiveSpec": {"importance_sequences": COUNT},
    "ProbeSpec": {
        "candidates": Range(2, 1000, also=(0,), why="0 = off; null = the default for the run's model family"),
        "tokens": TOKENS,
    },
}


def range_of(cls: type, name: str) -> Range | None:
    """The documented range of field `name` of settings dataclass `cls` (None: not a numeric setting)."""
    return RANGES.get(cls.__name__, {}).get(name)


def out_of_range(cls: type, values: Mapping[str, Any], key: str) -> str | None:
    """The refusal of the first of `values` (fields of `cls`, built under `key`) outside its range; None (unset) passes.
    A tuple field's range holds for each element."""
    for name, value in values.items():
        rng = range_of(cls, name)
        if rng is None or value is None:
            continue
        items = [(f"{key}.{name}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list | tuple) else [(f"{key}.{name}", value)]
        for k, v in items:
            if isinstance(v, bool) or not isinstance(v, int | float):
                return f"{k} must be a number, got {v!r}"
            if v not in rng:
                return rng.refusal(k, v)
    return None


def check_ranges(obj: Any, key: str) -> None:
    """Every numeric field of settings dataclass `obj` within its range (for objects made in code, not by `build`)."""
    message = out_of_range(type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, key)
    if message is not None:
        raise ConfigError(message)


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    """`value` finite and > 0 (>= 0 with allow_zero), else one ConfigError naming `key`."""
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
