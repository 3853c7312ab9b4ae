"""Analytic roofline cost model of a serving engine on one device.

Every operation takes max(FLOPs / (eta_c * peak), bytes / (eta_m * bandwidth)); a step adds a fixed
engine overhead and a per-kept-block overhead. A wave of B requests (B = the workload's concurrency,
or fewer when the KV cache cannot hold them) is prefilled together (TTFT), then decoded together at
the mean context P + O/2 (TPOT). Throughput = B * O / (TTFT + O * TPOT).

Because every layer offers the same options, per-layer costs are tables over (hidden size, option),
and for attention over (hidden size, query heads, KV option);
the expectation over a distribution is exact for additive terms (time, bytes) and evaluates the
non-linear ones (batch that fits, throughput) at expected memory: a plug-in estimate the final
architecture never relies on, since it is judged by `predict` on one architecture.
"""

from __future__ import annotations

import math

import torch

from autocompress.arch.space import SearchSpace
from autocompress.config.schema import Hardware, Workload
from autocompress.cost.base import ArchDistribution, CostModel

GIB = 1024.0**3
VERSION = 1


def reread_tokens(prompt_len: int, chunk: int) -> float:
    """Tokens' KV one prompt re-reads in chunked prefill: c = ceil(P / M) chunks, chunk j reads the j*M tokens before it."""
    c = math.ceil(prompt_len / chunk)
    return chunk * c * (c - 1) / 2


class AnalyticCostModel(CostModel):
    """Roofline model parameterised by `Hardware` (peaks, efficiencies, overheads) and `Workload`."""

    def __init__(self, space: SearchSpace, hardware: Hardware, workload: Workload) -> None:
        self.space, self.hw, self.wl = space, hardware, workload
        dt = torch.float64
        self._h = torch.tensor(space.hidden, dtype=dt)[:, None]  # [H, 1]
        self._kv = torch.tensor(space.attention, dtype=dt)[None, :]  # [1, A]
        self._q = torch.tensor(space.heads, dtype=dt)[None, :, None] * space.base.head_dim  # [1, Q, 1] query width
        self._i = torch.tensor(space.ffn, dtype=dt)[None, :]  # [1, F]
        self._flops = hardware.eta_compute * hardware.peak_tflops * 1e12  # FLOP/s, decode
        self._prefill_flops = (hardware.prefill_eta_compute or hardware.eta_compute) * hardware.peak_tflops * 1e12
        self._prefill_block_us = (
            hardware.block_overhead_us if hardware.prefill_block_overhead_us is None else hardware.prefill_block_overhead_us
        )
        self._prefill_attn_flops = (hardware.prefill_attn_eta or 0) * hardware.peak_tflops * 1e12 or self._prefill_flops
        self._prefill_overhead_ms = hardware.step_overhead_ms if hardware.prefill_overhead_ms is None else hardware.prefill_overhead_ms
        self._bw = hardware.eta_memory * hardware.mem_bandwidth_gbs * 1e9  # bytes/s

    @property
    def id(self) -> str:
        return f"analytic/{self.hw.name}/v{VERSION}"

    # ------------------------------------------------------------------ building blocks

    def _time(
        self, flops: torch.Tensor, nbytes: torch.Tensor, rows: torch.Tensor | float, prefill: bool = False, rate: float | None = None
    ) -> torch.Tensor:
        """Roofline time of one op in seconds: max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth).

        A matmul with few rows (decode: one per sequence) reaches only rows / (rows + m0) of the
        achievable FLOP/s, m0 = hardware.gemm_half_rows (0 = no such penalty).
        """
        achieved = (rate or (self._prefill_flops if prefill else self._flops)) * rows / (rows + self.hw.gemm_half_rows)
        return torch.maximum(flops / achieved, nbytes / self._bw)

    def _attn_shapes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Broadcastable (hidden [H, 1, 1], query width q = heads * hd [1, Q, 1], KV heads [1, 1, A])."""
        return self._h[:, :, None], self._q, self._kv[:, None, :]

    def _params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weight counts per hidden option: head [H], attention [H, Q, A], FFN [H, F].

        head = V*h (x2 untied) + h; attention = h + 2*h*q + 2*h*kv*hd (0 if no-op); FFN = h + 3*h*i.
        """
        b = self.space.base
        hd, v = b.head_dim, b.vocab_size
        h = self._h
        head = h[:, 0] * (v * (1 if b.tie_word_embeddings else 2) + 1)
        h3, q, kv = self._attn_shapes()
        attn = (h3 + 2 * h3 * q + 2 * h3 * kv * hd) * (kv > 0)
        ffn = (h + 3 * h * self._i) * (self._i > 0)
        return head, attn, ffn

    def _kv_per_token(self) -> torch.Tensor:
        """KV-cache bytes per token of one layer per attention option [A]: 2 * kv * hd * bytes."""
        return 2 * self._kv[0] * self.space.base.head_dim * self.wl.kv_bytes

    def _decode_tables(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Seconds of one decode step of `batch` sequences at context C = P + O/2: head [H], attn [H, Q, A], FFN [H, F].

        projections: 2*B*W FLOPs, W*bytes moved; attention core: 4*B*q*C FLOPs, B*C*2*kv*hd*kv_bytes;
        FFN: 2*B*3*h*i FLOPs, 3*h*i*bytes; LM head: 2*B*h*V FLOPs, h*V*bytes.
        """
        b, wl, hw = self.space.base, self.wl, self.hw
        hd, wb = b.head_dim, wl.weight_bytes
        ctx = wl.prompt_len + wl.output_len / 2
        h, i = self._h, self._i
        h3, q, kv = self._attn_shapes()
        w_proj = 2 * h3 * q + 2 * h3 * kv * hd
        attn = self._time(2 * batch * w_proj, wb * w_proj, batch)
        attn = attn + self._time(4 * batch * q * ctx * (kv > 0), batch * ctx * 2 * kv * hd * wl.kv_bytes, batch)
        attn = (attn + hw.block_overhead_us * 1e-6) * (kv > 0)
        w_ffn = 3 * h * i
        ffn = (self._time(2 * batch * w_ffn, wb * w_ffn, batch) + hw.block_overhead_us * 1e-6) * (i > 0)
        hv = h[:, 0] * b.vocab_size
        head = self._time(2 * batch * hv, wb * hv, batch) + hw.step_overhead_ms * 1e-3
        return head, attn, ffn

    def _prefill_tables(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Seconds to prefill `batch` prompts of P tokens (T = B*P tokens in ceil(T/M) chunks of M).

        projections: 2*T*W FLOPs, chunks*W*bytes + KV writes; attention core (causal): 2*B*q*P^2 FLOPs,
        KV writes plus the KV re-read of chunked prefill (a prompt longer than M prefills in c = ceil(P/M)
        chunks, chunk j reading the KV of the j*M tokens before it: B*M*c*(c-1)/2 tokens' KV);
        FFN: 2*T*3*h*i FLOPs; LM head on the last token of each prompt only: 2*B*h*V FLOPs.
        """
        b, wl, hw = self.space.base, self.wl, self.hw
        hd, wb, p = b.head_dim, wl.weight_bytes, wl.prompt_len
        tokens = batch * p
        chunks = math.ceil(float(tokens.detach()) / hw.max_num_batched_tokens)
        h, i = self._h, self._i
        h3, q, kv = self._attn_shapes()
        w_proj = 2 * h3 * q + 2 * h3 * kv * hd
        kv_bytes = tokens * 2 * kv * hd * wl.kv_bytes
        rows = tokens / chunks  # tokens per chunk
        attn = self._time(2 * tokens * w_proj, chunks * wb * w_proj + kv_bytes, rows, prefill=True)
        reread = batch * reread_tokens(p, hw.max_num_batched_tokens) * 2 * kv * hd * wl.kv_bytes
        attn = attn + self._time(2 * batch * q * p * p * (kv > 0), kv_bytes + reread, p, rate=self._prefill_attn_flops)
        attn = (attn + chunks * self._prefill_block_us * 1e-6) * (kv > 0)
        w_ffn = 3 * h * i
        ffn = (self._time(2 * tokens * w_ffn, chunks * wb * w_ffn, rows, prefill=True) + chunks * self._prefill_block_us * 1e-6) * (i > 0)
        hv = h[:, 0] * b.vocab_size
        head = self._time(2 * batch * hv, wb * hv, batch, prefill=True) + chunks * self._prefill_overhead_ms * 1e-3
        return head, attn, ffn

    def _expect(self, dist: ArchDistribution, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """E[head[h] + sum_l attn[h, q, a_l] + ffn[h, f_l]]: exact for independent choices."""
        head, attn, ffn = tables
        attn_h = (attn @ dist.attention.sum(0)) @ dist.query_heads(self.space)  # [H, Q] -> [H]
        per_h = head + attn_h + ffn @ dist.ffn.sum(0)  # [H]
        return dist.hidden @ per_h

    # ------------------------------------------------------------------ the interface

    def expected(self, dist: ArchDistribution) -> dict[str, torch.Tensor]:
        wl, hw = self.wl, self.hw
        dist = dist.to(torch.float64)
        weights = self._expect(dist, self._params()) * wl.weight_bytes  # bytes
        kv_tok = dist.attention.sum(0) @ self._kv_per_token()  # bytes per token, all layers
        h_mean = dist.hidden @ self._h[:, 0]
        # activation workspace: a few fp32 hidden-size buffers per batched token + fp32 logits per sequence
        rows = min(hw.max_num_batched_tokens, wl.concurrency)
        workspace = 4.0 * (4 * hw.max_num_batched_tokens * h_mean + rows * self.space.base.vocab_size)
        overhead = hw.memory_overhead_gib * GIB
        seq_tokens = wl.prompt_len + wl.output_len
        kv_demand = kv_tok * wl.kv_tokens
        memory = weights + kv_demand + workspace + overhead
        if hw.kv_cache_gib is not None:  # engines with a fixed KV-cache size (vLLM CPU)
            kv_space = torch.tensor(hw.kv_cache_gib * GIB, dtype=torch.float64)
        else:  # GPU engines take what is left of their memory share
            kv_space = hw.memory_utilization * hw.memory_gib * GIB - weights - workspace - overhead
        capacity = kv_space / kv_tok.clamp(min=1e-9)  # tokens the KV cache holds
        fits = capacity / seq_tokens  # sequences the KV cache holds
        batch = torch.clamp(torch.minimum(fits, torch.tensor(float(wl.concurrency), dtype=torch.float64)), min=1e-3)
        tpot = self._expect(dist, self._decode_tables(batch))
        ttft = self._expect(dist, self._prefill_tables(batch))
        throughput = batch * wl.output_len / (ttft + wl.output_len * tpot)
        throughput = torch.where(fits >= 1, throughput, torch.zeros_like(throughput))  # cannot hold one sequence
        return {
            "ttft_ms": ttft * 1e3,
            "tpot_ms": tpot * 1e3,
            "throughput_tok_s": throughput,
            "memory_gib": memory / GIB,
            "kv_capacity_tokens": capacity,
        }
