"""Estimates from NVIDIA's aiconfigurator-core: vLLM kernel latencies measured on datacenter GPUs.

aiconfigurator-core (PyPI, Apache-2.0, pinned 0.12.0) ships per-operation latency tables measured
with vLLM 0.24.0 on h100_sxm, h200_sxm, b200_sxm, rtx_pro_6000_server and others, and composes
them into a model's prefill and decode time ("static" mode: one batch prefilled together, then
decoded together). It is evidence from measured kernels, not an end-to-end measurement: static
mode has no per-step scheduler/sampler overhead, and its own error against serving is not
published as one figure. Everything taken from it is labelled `source` = SOURCE.

Heterogeneous architectures are estimated block by block, never through aiconfigurator's
NemotronNAS model (which reads only `ffn_mult`, replacing an explicit intermediate size by 3.5x
hidden, rounds FFN widths up to multiples of 256 and reports a DeciLM KV cache of 0 bytes): each
(hidden, query heads, KV heads) attention block and each (hidden, FFN width) block is a one-layer
Llama model of those shapes, and an architecture's time is the embedding and LM head plus the sum
of its kept blocks (no-op blocks cost nothing, as in vLLM's DeciLM). KV-head counts the attention
tables do not hold (3, 5, 6, 7, ...) are interpolated linearly between the nearest counts they do
hold, per operation; `interpolated_kv` lists where that happened. KV-cache sizes stay the
project's exact count (Architecture.kv_bytes_per_token).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

from autocompress.arch.space import Architecture
from autocompress.config.schema import Hardware, Workload
from autocompress.errors import ConfigError

PINNED = "0.12.0"
BACKEND_VERSION = "0.24.0"  # the vLLM version of the tables
INSTALL = "pip install 'autocompress[aiconfigurator]' (aiconfigurator-core==0.12.0)"

ATTENTION_OPS = ("add_norm_1", "qkv_gemm", "attention", "proj_gemm", "ar_1")
FFN_OPS = ("add_norm_2", "gate_ffn1_gemm", "act_gate", "ffn2_gemm", "ar_2")
HEAD_OPS = ("embedding", "logits_gemm", "embedding_ar", "p2p")
DTYPES = {"bf16": None, "fp16": None, "fp8": "fp8"}  # workload dtype -> aiconfigurator quant mode (None = the config's bf16)
Quant = tuple[str | None, str | None]  # aiconfigurator's (gemm_quant_mode, kvcache_quant_mode): the weights' and the KV cache's


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aiconfigurator-core")
    except PackageNotFoundError:
        return None


def source_label(system: str) -> str:
    return f"aiconfigurator-core {installed_version()}, vllm {BACKEND_VERSION} tables, {system}"


def require() -> None:
    found = installed_version()
    if found is None:
        raise ConfigError(f"the aiconfigurator source needs aiconfigurator-core {PINNED}: {INSTALL}")
    if found != PINNED:
        raise ConfigError(
            f"aiconfigurator-core {found} is installed; this release is built on {PINNED} (its table layout and op names): {INSTALL}"
        )


class Estimator:
    """Per-block prefill and decode latencies of one GPU system's vLLM tables, cached per block shape."""

    def __init__(self, system: str) -> None:
        require()
        logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)  # its table loader warns per fallback file
        from aiconfigurator_core.sdk.engine import EngineHandle

        self.system = system
        self._handle = EngineHandle
        self._dir = tempfile.TemporaryDirectory(prefix="autocompress-aic-")
        self.interpolated_kv: set[int] = set()
        self.missing: dict[tuple[int, ...], str] = {}  # shape -> aiconfigurator's error

    @property
    def source(self) -> str:
        return source_label(self.system)

    # ------------------------------------------------------------------ one-layer models

    def _config(self, hidden: int, heads: int, head_dim: int, kv: int, ffn: int, vocab: int) -> str:
        """Folder of a one-layer Llama config.json (aiconfigurator caches compiled models by path: one folder per shape)."""
        folder = Path(self._dir.name) / f"h{hidden}_q{heads}_d{head_dim}_kv{kv}_i{ffn}_v{vocab}"
        if not folder.exists():
            folder.mkdir()
            config = {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": ffn,
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "head_dim": head_dim,
                "num_hidden_layers": 1,
                "vocab_size": vocab,
                "max_position_embeddings": 131072,
                "hidden_act": "silu",
                "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
            }
            (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    @functools.cache  # noqa: B019 - one estimator per profile run; the cache is the point
    def _ops(
        self, shape: tuple[int, int, int, int, int, int], batch: int, isl: int, osl: int, quant: Quant
    ) -> dict[str, tuple[float, float]] | None:
        """op name -> (prefill ms of the batch, decode ms per step) of a one-layer model; None where the tables lack it."""
        from aiconfigurator_core.sdk.errors import PerfDataNotAvailableError

        kwargs: dict[str, Any] = {"backend_version": BACKEND_VERSION}
        gemm, kv = quant
        if gemm:
            kwargs["gemm_quant_mode"] = gemm
        if kv:
            kwargs["kvcache_quant_mode"] = kv
        try:
            handle = self._handle.compile(self._config(*shape), self.system, "vllm", **kwargs)
            ctx, gen = handle.run_static_per_op(batch_size=batch, isl=isl, osl=osl)
        except PerfDataNotAvailableError as exc:  # cached too: a missing table entry is looked up once
            self.missing[shape] = str(exc)
            return None
        steps = max(osl - 1, 1)
        out: dict[str, list[float]] = {}
        for name, ms, *_ in ctx:
            out.setdefault(name.removeprefix("context_"), [0.0, 0.0])[0] += ms
        for name, ms, *_ in gen:
            out.setdefault(name.removeprefix("generation_"), [0.0, 0.0])[1] += ms / steps
        known = set(ATTENTION_OPS + FFN_OPS + HEAD_OPS)
        unknown = sorted(k for k, (a, b) in out.items() if k not in known and (a or b))
        if unknown:
            raise ConfigError(
                f"aiconfigurator-core reported ops this adapter does not place ({unknown}); it is built on {PINNED}: {INSTALL}"
            )
        return {k: (a, b) for k, (a, b) in out.items()}

    def _sum(self, shape: tuple[int, int, int, int, int, int], names: tuple[str, ...], *args: Any) -> tuple[float, float] | None:
        ops = self._ops(shape, *args)
        if ops is None:
            return None
        return sum(ops.get(n, (0.0, 0.0))[0] for n in names), sum(ops.get(n, (0.0, 0.0))[1] for n in names)

    def _required(self, shape: tuple[int, int, int, int, int, int], names: tuple[str, ...], *args: Any) -> tuple[float, float]:
        found = self._sum(shape, names, *args)
        if found is None:
            raise ConfigError(
                f"aiconfigurator's {self.system} vLLM tables hold no data for a block of shape {shape}: {self.missing[shape]}"
            )
        return found

    def attention(self, arch: Architecture, kv: int, batch: int, isl: int, osl: int, quant: Quant) -> tuple[float, float]:
        """(prefill ms, decode ms per step) of one attention block with `kv` KV heads."""
        shape = (arch.hidden_size, arch.num_attention_heads, arch.head_dim, kv, 256, arch.vocab_size)
        found = self._sum(shape, ATTENTION_OPS, batch, isl, osl, quant)
        if found is not None:
            return found
        lo, hi = _neighbours(kv, arch.num_attention_heads)
        if lo is None or hi is None:
            raise ConfigError(f"aiconfigurator's {self.system} tables hold no attention data near {kv} KV heads: {self.missing[shape]}")
        self.interpolated_kv.add(kv)
        a, b = self.attention(arch, lo, batch, isl, osl, quant), self.attention(arch, hi, batch, isl, osl, quant)
        w = (kv - lo) / (hi - lo)
        return a[0] + w * (b[0] - a[0]), a[1] + w * (b[1] - a[1])

    def ffn(self, arch: Architecture, width: int, batch: int, isl: int, osl: int, quant: Quant) -> tuple[float, float]:
        shape = (arch.hidden_size, arch.num_attention_heads, arch.head_dim, 1, width, arch.vocab_size)
        return self._required(shape, FFN_OPS, batch, isl, osl, quant)

    def head(self, arch: Architecture, batch: int, isl: int, osl: int, quant: Quant) -> tuple[float, float]:
        shape = (arch.hidden_size, arch.num_attention_heads, arch.head_dim, 1, 256, arch.vocab_size)
        return self._required(shape, HEAD_OPS, batch, isl, osl, quant)

    # ------------------------------------------------------------------ one architecture

    def estimate(self, arch: Architecture, workload: Workload, batch: int) -> dict[str, float]:
        """TTFT (prefill of `batch` prompts together), TPOT (one decode step of the batch), wave throughput."""
        if workload.dtype not in DTYPES or (workload.kv_dtype or workload.dtype) not in DTYPES:
            raise ConfigError(
                f"the aiconfigurator source covers workload dtypes {sorted(DTYPES)}, not {workload.dtype!r}/{workload.kv_dtype!r}"
            )
        quant = (DTYPES[workload.dtype], DTYPES[workload.kv_dtype or workload.dtype])
        batch, isl, osl = max(int(batch), 1), workload.prompt_len, workload.output_len
        ttft, tpot = self.head(arch, batch, isl, osl, quant)
        for kv in (b.kv_heads for b in arch.blocks if b.kv_heads):
            p, d = self.attention(arch, kv, batch, isl, osl, quant)
            ttft, tpot = ttft + p, tpot + d
        for width in (b.ffn for b in arch.blocks if b.ffn):
            p, d = self.ffn(arch, width, batch, isl, osl, quant)
            ttft, tpot = ttft + p, tpot + d
        throughput = batch * osl / ((ttft + osl * tpot) / 1e3)
        return {"ttft_ms": ttft, "tpot_ms": tpot, "throughput_tok_s": throughput}

    def served(self, arch: Architecture, workload: Workload, batch: int, hardware: Hardware) -> dict[str, float]:
        """`estimate` plus what static mode leaves out: the hardware file's per-step overhead on TPOT and its
        per-chunk prefill overhead on TTFT (chunks of max_num_batched_tokens); the raw figures as aic_*."""
        raw = self.estimate(arch, workload, batch)
        chunk_ms = hardware.step_overhead_ms if hardware.prefill_overhead_ms is None else hardware.prefill_overhead_ms
        chunks = math.ceil(max(int(batch), 1) * workload.prompt_len / hardware.max_num_batched_tokens)
        ttft, tpot = raw["ttft_ms"] + chunks * chunk_ms, raw["tpot_ms"] + hardware.step_overhead_ms
        throughput = max(int(batch), 1) * workload.output_len / ((ttft + workload.output_len * tpot) / 1e3)
        return {"ttft_ms": ttft, "tpot_ms": tpot, "throughput_tok_s": throughput, **{f"aic_{k}": v for k, v in raw.items()}}


def _neighbours(kv: int, heads: int) -> tuple[int | None, int | None]:
    """The powers of two around `kv` (the KV-head counts every table holds), capped at the query heads."""
    lo = 1 << (kv.bit_length() - 1) if kv > 1 else None
    hi = 1 << kv.bit_length()
    return lo, hi if hi <= max(heads, 1) * 2 else None


def system_peaks(system: str) -> dict[str, float]:
    """The datasheet peaks aiconfigurator's system file gives (dense BF16 tensor TFLOP/s, memory GB/s)."""
    from importlib.resources import files

    import yaml

    require()
    text = (files("aiconfigurator_core") / "systems" / f"{system}.yaml").read_text()
    gpu = yaml.safe_load(text)["gpu"]
    return {"peak_tflops": float(gpu["bfloat16_tc_flops"]) / 1e12, "mem_bandwidth_gbs": float(gpu["mem_bw"]) / 1e9}
