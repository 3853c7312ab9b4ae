"""Measuring architectures in the real serving engine (vLLM), one Ray actor per engine.

Each candidate is written as a weight-free DeciLM checkpoint and served with `load_format="dummy"`
(the weights' values do not change the cost). For every workload a wave of `concurrency` prompts
is served with `output_len` tokens each; the engine's per-request timestamps give TTFT (when the
last request got its first token: the wave's prefill) and TPOT (median over requests of the time
between first and last token / (output_len - 1)); throughput = concurrency * output_len / wall
time of the wave. Warm-up waves come first; repeats give medians and spreads. vLLM is imported only inside the actor: it
spawns processes and does not reliably free memory, so each engine lives in its own actor process,
which is killed afterwards.

Here: the Ray dispatch (one actor per engine, as many as the cluster has devices) and engine rows -> metrics; the
settings live in autocompress.cost.engine_settings, the measuring inside the actor in autocompress.cost.engine_run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from autocompress.arch.space import Architecture
from autocompress.config.schema import Workload
from autocompress.cost.engine_run import engine_accounting, measure_in_process, memory_split  # noqa: F401  (re-exported)
from autocompress.cost.engine_settings import (  # noqa: F401  (re-exported: the engine's names stay importable from here)
    VLLM_DTYPES,
    EngineSettings,
    arch_id,
    cache_kwargs,
    engine_kv_pin,
    engine_settings,
    kv_pin_bytes,
    require_vllm,
    settings_dict,
    settings_for,
)
from autocompress.errors import ConfigError

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


def make_actor_class(settings: EngineSettings) -> Any:
    """A Ray actor class owning one device (num_gpus=1 on GPU; the node's CPUs on a CPU node)."""
    import ray

    resources: dict[str, Any] = {"num_gpus": 1} if settings.engine != "vllm-cpu" else {"num_cpus": _node_cpus()}

    @ray.remote(max_restarts=0, **resources)
    class EngineActor:
        def measure(self, arch_json: str, base_config: dict[str, Any], workloads: list[Workload]) -> list[dict[str, Any]]:
            return measure_in_process(arch_json, base_config, workloads, settings)

    return EngineActor


def check_devices(settings: EngineSettings) -> int:
    """How many engines run at once: one per GPU, or one per CPU node; a GPU engine on a cluster without a GPU is
    refused (its actors would wait for one forever)."""
    import ray

    alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if settings.engine == "vllm-cpu":
        return max(1, len(alive))
    gpus = int(sum(r.get("GPU", 0) for r in alive))
    if gpus == 0:
        raise ConfigError(
            f"the engine ({settings.engine}) serves this hardware on a GPU and the Ray cluster has none: run where that GPU "
            "is (ray.address=HOST:PORT of a cluster with it), or estimate it: verify.source=aiconfigurator / profile.source=aiconfigurator"
        )
    return gpus


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

    slots = check_devices(settings)  # before any actor asks for a device the cluster does not have
    cls = make_actor_class(settings)
    queue, pending = list(archs), dict[Any, tuple[Architecture, Any, float]]()

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
