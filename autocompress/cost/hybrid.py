"""Analytic serving cost of hybrid Mamba / MoE / attention shapes: memory line by line, TTFT, TPOT, throughput.

The same roofline and the same wave as the dense model (autocompress.cost.analytic): every
operation takes max(FLOPs / (eta_c * peak), bytes / (eta_m * bandwidth)); a wave of B requests
(the workload's concurrency, or fewer when memory cannot hold them) is prefilled in chunks of
max_num_batched_tokens (TTFT), then decoded together at the mean context P + O/2 (TPOT);
throughput = B * O / (TTFT + O * TPOT). What is new for hybrids:

- MoE: a step reads only the experts its tokens touch. With top-k of E experts and routing taken
  as uniform (no router statistics without weights), m tokens touch u(m) = E * (1 - (1 - k/E)^m)
  distinct experts: bytes follow u(m) experts, FLOPs the k active ones per token, and each
  expert's matmul has m*k/u(m) rows. Memory holds all E.
- Mamba-2: a fixed state per sequence, nh * p * N values in mamba_ssm_cache_dtype plus the
  convolution's last K-1 inputs, read and written every decode step, instead of a KV cache that
  grows with the context. Prefill runs the chunked scan (chunk L): 2 * T * nh * (L * (N + p) + 2 * N * p) FLOPs.
- Attention: the KV cache as in the dense model, only in the attention blocks; dense MLP blocks
  (up and down projections) as the dense model's FFN.

Shapes are dicts of equal-length arrays (see autocompress.arch.hybrid), so one call prices a grid.
Nothing here is fitted to a hybrid model served by an engine: the efficiencies are the hardware's
(or the dense fit's, see autocompress.plan), and the prediction is labelled analytic.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from autocompress.arch.hybrid import SSM_BYTES, HybridModel, parameters
from autocompress.arch.moe_pruning import MoEShape, hybrid_shapes
from autocompress.config.families import HYBRID_MOE
from autocompress.config.metrics import METRICS, Constraint
from autocompress.config.schema import Hardware, Workload
from autocompress.cost.analytic import reread_tokens
from autocompress.cost.fitted import latest_record, with_terms
from autocompress.errors import ConfigError

GIB = 1024.0**3
Shape = Mapping[str, np.ndarray]


def per_expert(rows: np.ndarray | float, k: int, used: np.ndarray) -> np.ndarray:
    """Rows each touched expert's matmul gets: rows * k / used (1 where no expert is used)."""
    total = np.broadcast_to(np.asarray(rows, dtype=np.float64) * k, np.shape(used))
    return np.divide(total, used, out=np.ones(np.shape(used)), where=used > 0)


def touched(experts: np.ndarray, k: int, tokens: np.ndarray | float) -> np.ndarray:
    """Expected distinct experts that `tokens` tokens route to, each picking k of E at random: E * (1 - (1 - k/E)^tokens)."""
    e = np.asarray(experts, dtype=np.float64)
    share = np.divide(k, e, out=np.ones_like(e), where=e > 0)  # no experts: none touched
    return e * (1.0 - (1.0 - share) ** tokens)


class HybridCost:
    """Roofline cost of Nemotron-H shapes on one device under one workload."""

    def __init__(self, model: HybridModel, hardware: Hardware, workload: Workload, chunk: int = 128) -> None:
        self.model, self.hw, self.wl, self.chunk = model, hardware, workload, chunk
        self._flops = hardware.eta_compute * hardware.peak_tflops * 1e12
        self._prefill_flops = (hardware.prefill_eta_compute or hardware.eta_compute) * hardware.peak_tflops * 1e12
        self._attn_flops = (hardware.prefill_attn_eta or 0) * hardware.peak_tflops * 1e12 or self._prefill_flops
        self._bw = hardware.eta_memory * hardware.mem_bandwidth_gbs * 1e9

    def _time(self, flops: np.ndarray, nbytes: np.ndarray, rows: np.ndarray | float, rate: float | None = None) -> np.ndarray:
        """Seconds: max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth); few rows reach rows / (rows + m0) of the FLOP/s."""
        achieved = (rate or self._flops) * rows / (rows + self.hw.gemm_half_rows)
        return np.maximum(flops / achieved, nbytes / self._bw)

    def _widths(self, s: Shape) -> dict[str, np.ndarray]:
        """Weight counts of one block's matmuls: mamba projections, attention projections, expert, router, latent, shared."""
        m, h = self.model, s["hidden_size"].astype(np.float64)
        di = s["mamba_num_heads"] * s["mamba_head_dim"]
        latent = m.moe_latent_size or h
        mats = 3.0 if m.gated_mlp else 2.0
        return {
            "mamba": h * (2 * di + 2 * m.n_groups * m.ssm_state_size + s["mamba_num_heads"]) + di * h,
            "attention": 2 * h * s["num_attention_heads"] * m.head_dim + 2 * h * m.num_key_value_heads * m.head_dim,
            "expert": mats * s["moe_intermediate_size"] * latent,
            "moe_dense": h * s["n_routed_experts"]
            + (2 * h * latent if m.moe_latent_size else 0)
            + mats * h * s["moe_shared_expert_intermediate_size"],
            "mlp": mats * h * s["intermediate_size"],
            "head": h * m.vocab_size,
        }

    def state_bytes(self, s: Shape) -> np.ndarray:
        """Mamba state of one sequence, all Mamba blocks: nh * p * N * ssm bytes + (K - 1) * (nh * p + 2 * g * N) * weight bytes."""
        m = self.model
        di = s["mamba_num_heads"] * s["mamba_head_dim"]
        per_layer = di * m.ssm_state_size * SSM_BYTES[m.mamba_ssm_cache_dtype]
        per_layer = per_layer + (m.conv_kernel - 1) * (di + 2 * m.n_groups * m.ssm_state_size) * self.wl.weight_bytes
        return s["mamba_layers"] * per_layer

    def kv_per_token(self, s: Shape) -> np.ndarray:
        """KV-cache bytes per token, all attention blocks: blocks * 2 (K, V) * nkv * hd * kv bytes."""
        m = self.model
        return s["attention_layers"] * 2.0 * m.num_key_value_heads * m.head_dim * self.wl.kv_bytes

    def memory(self, s: Shape, params: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """GiB by line: weights (by part), KV cache, Mamba state, workspace, engine overhead, and their sum `memory_gib`.

        KV cache: attention blocks * 2 * nkv * hd * kv bytes per token, for workload.kv_tokens =
        max(context_len, concurrency * (P + O)) tokens (as the dense model); Mamba state: concurrency
        sequences; workspace: fp32 buffers of a prefill chunk, 4 * (4 * M * h + rows * V) bytes.
        """
        m, wl, hw = self.model, self.wl, self.hw
        params = parameters(m, s) if params is None else params
        lines = {f"weights_{k}_gib": v * wl.weight_bytes / GIB for k, v in params.items() if k not in ("total", "active")}
        rows = min(hw.max_num_batched_tokens, wl.concurrency)
        workspace = 4.0 * (4 * hw.max_num_batched_tokens * s["hidden_size"] + rows * m.vocab_size)
        lines |= {
            "weights_gib": params["total"] * wl.weight_bytes / GIB,
            "kv_cache_gib": self.kv_per_token(s) * wl.kv_tokens / GIB,
            "mamba_state_gib": wl.concurrency * self.state_bytes(s) / GIB,
            "workspace_gib": workspace / GIB,
            "overhead_gib": np.full_like(workspace, hw.memory_overhead_gib),
        }
        lines["memory_gib"] = np.sum(
            [lines[k] for k in ("weights_gib", "kv_cache_gib", "mamba_state_gib", "workspace_gib", "overhead_gib")], axis=0
        )
        return lines

    def _decode(self, s: Shape, batch: np.ndarray) -> np.ndarray:
        """Seconds of one decode step of `batch` sequences at context C = P + O/2, summed over blocks (formulas above)."""
        m, wl, hw = self.model, self.wl, self.hw
        w, wb, block = self._widths(s), wl.weight_bytes, hw.block_overhead_us * 1e-6
        ctx = wl.prompt_len + wl.output_len / 2
        di = s["mamba_num_heads"] * s["mamba_head_dim"]
        mamba = self._time(2 * batch * w["mamba"], wb * w["mamba"], batch)
        mamba = mamba + self._time(
            6 * batch * di * m.ssm_state_size, 2 * batch * self.state_bytes(s) / np.maximum(s["mamba_layers"], 1), batch
        )
        q = s["num_attention_heads"] * m.head_dim
        attn = self._time(2 * batch * w["attention"], wb * w["attention"], batch)
        attn = attn + self._time(4 * batch * q * ctx, batch * ctx * 2 * m.num_key_value_heads * m.head_dim * wl.kv_bytes, batch)
        u = touched(s["n_routed_experts"], m.num_experts_per_tok, batch)
        k = m.num_experts_per_tok
        moe = self._time(2 * batch * k * w["expert"], wb * u * w["expert"], per_expert(batch, k, u))
        moe = moe + self._time(2 * batch * w["moe_dense"], wb * w["moe_dense"], batch)
        mlp = self._time(2 * batch * w["mlp"], wb * w["mlp"], batch)
        head = self._time(2 * batch * w["head"], wb * w["head"], batch) + hw.step_overhead_ms * 1e-3
        blocks = s["mamba_layers"] * (mamba + block) + s["attention_layers"] * (attn + block) + s["moe_layers"] * (moe + block)
        return head + blocks + s["mlp_layers"] * (mlp + block)

    def _prefill(self, s: Shape, batch: np.ndarray) -> np.ndarray:
        """Seconds to prefill `batch` prompts of P tokens: T = B * P tokens in ceil(T / M) chunks of M, summed over blocks;
        attention counts the KV re-read of chunked prefill as the dense model does (analytic.reread_tokens)."""
        m, wl, hw = self.model, self.wl, self.hw
        w, wb, p = self._widths(s), wl.weight_bytes, wl.prompt_len
        tokens = batch * p
        chunks = np.ceil(tokens / hw.max_num_batched_tokens)
        rows = tokens / chunks
        block_us = hw.block_overhead_us if hw.prefill_block_overhead_us is None else hw.prefill_block_overhead_us
        block = chunks * block_us * 1e-6
        pf = self._prefill_flops
        nh, hp, n = s["mamba_num_heads"], s["mamba_head_dim"], m.ssm_state_size
        scan = 2 * tokens * nh * (self.chunk * (n + hp) + 2 * n * hp)
        mamba = self._time(2 * tokens * w["mamba"], chunks * wb * w["mamba"], rows, pf) + self._time(
            scan, 2 * tokens * nh * hp * wb, rows, pf
        )
        kv_bytes = tokens * 2 * m.num_key_value_heads * m.head_dim * wl.kv_bytes
        q = s["num_attention_heads"] * m.head_dim
        attn = self._time(2 * tokens * w["attention"], chunks * wb * w["attention"] + kv_bytes, rows, pf)
        reread = batch * reread_tokens(p, hw.max_num_batched_tokens) * 2 * m.num_key_value_heads * m.head_dim * wl.kv_bytes
        attn = attn + self._time(2 * batch * q * p * p, kv_bytes + reread, p, self._attn_flops)
        k = m.num_experts_per_tok
        u = touched(s["n_routed_experts"], k, rows)
        moe = self._time(2 * tokens * k * w["expert"], chunks * wb * u * w["expert"], per_expert(rows, k, u), pf)
        moe = moe + self._time(2 * tokens * w["moe_dense"], chunks * wb * w["moe_dense"], rows, pf)
        overhead = hw.step_overhead_ms if hw.prefill_overhead_ms is None else hw.prefill_overhead_ms
        mlp = self._time(2 * tokens * w["mlp"], chunks * wb * w["mlp"], rows, pf)
        head = self._time(2 * batch * w["head"], wb * w["head"], batch, pf) + chunks * overhead * 1e-3
        blocks = s["mamba_layers"] * (mamba + block) + s["attention_layers"] * (attn + block) + s["moe_layers"] * (moe + block)
        return head + blocks + s["mlp_layers"] * (mlp + block)

    def predict(self, s: Shape, whole_wave: bool = False) -> dict[str, np.ndarray]:
        """Memory lines, parameters, `sequences_fit` (how many sequences memory holds), batch, TTFT, TPOT, throughput.

        The batch is the workload's concurrency or the sequences that fit, whichever is smaller; `whole_wave`
        prices the whole wave even where it does not fit (the base model that relative bounds refer to).
        """
        m, wl, hw = self.model, self.wl, self.hw
        params = parameters(m, s)
        out = self.memory(s, params)
        free = hw.memory_utilization * hw.memory_gib * GIB - (out["weights_gib"] + out["workspace_gib"] + out["overhead_gib"]) * GIB
        per_sequence = self.kv_per_token(s) * (wl.prompt_len + wl.output_len) + self.state_bytes(s)
        fits = free / np.maximum(per_sequence, 1.0)
        batch = np.full_like(fits, wl.concurrency) if whole_wave else np.clip(np.minimum(fits, wl.concurrency), 1e-3, None)
        ttft, tpot = self._prefill(s, batch), self._decode(s, batch)
        throughput = np.where((fits >= 1) | whole_wave, batch * wl.output_len / (ttft + wl.output_len * tpot), 0.0)
        return out | {
            "params": params["total"],
            "active_params": params["active"],
            "sequences_fit": fits,
            "batch": batch,
            "ttft_ms": ttft * 1e3,
            "tpot_ms": tpot * 1e3,
            "throughput_tok_s": throughput,
        }


def hardware_terms(hw: Hardware, choice: str) -> tuple[Hardware, str]:
    """The hardware with the efficiencies the plan uses, and where they come from."""
    if choice not in ("auto", "analytic"):
        raise ConfigError(f"cost_model={choice!r}: the planner takes auto or analytic (fitted files are fitted to dense models)")
    record = latest_record(None, hw.name, hw.engine) if choice == "auto" and not hw.cpu else None
    if record is None:
        return hw, f"analytic/{hw.name} (the hardware file's efficiencies)"
    source = record.get("source_kind") or "engine"
    return with_terms(
        hw, record["parameters"]
    ), f"analytic/{hw.name}, efficiencies of the dense-model fit {record['hardware']}/{source} (shipped)"


def evaluate(cost: HybridCost, shapes: Mapping[str, np.ndarray], constraints: tuple[Constraint, ...]) -> pd.DataFrame:
    """Shapes with their predictions, `fits_device` and `feasible` (that, and each constraint met).

    Fitting the device: the engine's memory share holds the weights, the workload's whole wave and a
    KV cache for context_len tokens (vLLM refuses to start where one max-length sequence does not fit).
    """
    out = cost.predict(shapes)
    df = pd.DataFrame({**shapes, **out})
    share = cost.hw.memory_utilization * cost.hw.memory_gib
    df["fits_device"] = (df["sequences_fit"] >= cost.wl.concurrency) & (df["memory_gib"] <= share * (1 + 1e-9))
    ok = df["fits_device"].copy()
    for c in constraints:
        ok &= c.satisfied(df[c.metric])  # elementwise on a column
    df["feasible"] = ok
    df["memory_headroom_gib"] = (
        min([share, *(c.value for c in constraints if c.metric == "memory_gib")]) - df["memory_gib"]
    )  # what is left under the tighter of the device and the bound
    return df


# --------------------------------------------------------------------------- compare's view of a hybrid-MoE run


@dataclass(frozen=True)
class HybridArch:
    """A GraniteMoeHybrid shape as compare's tables need it: parameters, its JSON (the trials' `architecture`), its costs."""

    shape: MoEShape
    layer_types: tuple[str, ...]  # the base model's, per layer
    params: int

    def num_params(self) -> int:
        return self.params

    def is_homogeneous(self) -> bool:
        return True  # this format holds one width per axis for the whole model

    def to_json(self) -> str:
        kept = [self.layer_types[i] for i in self.shape.layers]
        return json.dumps({"family": HYBRID_MOE, **asdict(self.shape), "layers": list(self.shape.layers), "layer_types": kept})


@dataclass
class HybridCostModel:
    """compare's view of the sweep's hybrid roofline: an id (the trials' `cost_model`) and each shape's predicted costs."""

    cost: HybridCost
    layer_types: list[str]  # the base model's
    id: str

    def arch(self, shape: MoEShape) -> HybridArch:
        return HybridArch(shape, tuple(self.layer_types), int(price(self.cost, self.layer_types, [shape], ()).loc[0, "params"]))

    def predict(self, arch: HybridArch) -> dict[str, float]:
        row = price(self.cost, self.layer_types, [arch.shape], ()).loc[0]
        return {k: float(row[k]) for k in METRICS}


def price(cost: HybridCost, layer_types: list[str], shapes: list[MoEShape], constraints: tuple[Constraint, ...]) -> pd.DataFrame:
    """The hybrid roofline's table for `shapes` (one row each, in order): costs, params, fits_device, feasible."""
    return evaluate(cost, hybrid_shapes(cost.model, layer_types, shapes), constraints).reset_index(drop=True)
