"""Inside the measuring actor: start vLLM on a weight-free checkpoint, time waves of the workload, account the
engine's memory. vLLM is imported here, in the actor process only (autocompress.cost.engine dispatches it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autocompress.arch.space import Architecture
from autocompress.config.schema import DTYPE_BYTES, Workload
from autocompress.cost.engine_settings import EngineSettings, cache_kwargs, engine_kv_pin


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
