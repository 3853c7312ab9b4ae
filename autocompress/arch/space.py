"""Architectures in the nemotron-nas (DeciLM) `block_configs` form, and the search space over them.

One global hidden size and one global query-head count (whole heads removed within every KV group,
as Minitron prunes them); per layer an attention block (kept with some KV heads, or no-op) and an
FFN block (an intermediate size, or no-op).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from autocompress.config.schema import SpaceSpec
from autocompress.errors import ConfigError


@dataclass(frozen=True)
class Block:
    """One decoder layer: `kv_heads` = 0 means no-op attention, `ffn` = 0 means no-op FFN."""

    kv_heads: int
    ffn: int


@dataclass(frozen=True)
class Architecture:
    """A (possibly heterogeneous) Llama-family decoder."""

    hidden_size: int
    num_attention_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    blocks: tuple[Block, ...]

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    # ------------------------------------------------------------------ counts

    def num_params(self) -> int:
        """Exact parameter count of the Llama/DeciLM module with these shapes (no biases).

        embedding V*d (+ an untied LM head V*d) + final norm d + per layer:
          attention kept: input norm d + q d*(nq*hd) + k,v 2*d*(kv*hd) + o (nq*hd)*d
          FFN kept:       post-attention norm d + gate/up/down 3*d*i
        """
        d, q = self.hidden_size, self.num_attention_heads * self.head_dim
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        for b in self.blocks:
            if b.kv_heads:
                total += d + 2 * d * q + 2 * d * b.kv_heads * self.head_dim
            if b.ffn:
                total += d + 3 * d * b.ffn
        return total

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """KV cache per token: sum over kept attention layers of 2 (K and V) * kv_heads * head_dim * bytes."""
        return sum(2 * b.kv_heads * self.head_dim * dtype_bytes for b in self.blocks)

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs of one token attending to `context` earlier tokens (the LM head included).

        2 FLOPs per weight of every matmul (embedding lookup excluded) + attention scores and values:
        4 * nq * hd * context per kept attention layer.
        """
        d, q = self.hidden_size, self.num_attention_heads * self.head_dim
        flops = 2.0 * d * self.vocab_size
        for b in self.blocks:
            if b.kv_heads:
                flops += 2.0 * (2 * d * q + 2 * d * b.kv_heads * self.head_dim) + 4.0 * q * context
            if b.ffn:
                flops += 2.0 * 3 * d * b.ffn
        return flops

    def is_homogeneous(self) -> bool:
        return len(set(self.blocks)) == 1

    # ------------------------------------------------------------------ serialisation

    def block_configs(self) -> list[dict[str, Any]]:
        """DeciLM `block_configs`: n_heads_in_group = query heads / KV heads of the layer."""
        out = []
        for b in self.blocks:
            attention: dict[str, Any] = {"no_op": b.kv_heads == 0, "replace_with_linear": False}
            attention["n_heads_in_group"] = self.num_attention_heads // b.kv_heads if b.kv_heads else None
            ffn = {"no_op": b.ffn == 0, "replace_with_linear": False, "intermediate_size": b.ffn or None}
            out.append({"attention": attention, "ffn": ffn})
        return out

    def to_json(self) -> str:
        return json.dumps(
            {
                "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_attention_heads,
                "head_dim": self.head_dim,
                "vocab_size": self.vocab_size,
                "tie_word_embeddings": self.tie_word_embeddings,
                "block_configs": self.block_configs(),
            },
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(text: str) -> Architecture:
        raw = json.loads(text)
        blocks = []
        for bc in raw["block_configs"]:
            att, ffn = bc["attention"], bc["ffn"]
            kv = 0 if att["no_op"] else raw["num_attention_heads"] // att["n_heads_in_group"]
            blocks.append(Block(kv_heads=kv, ffn=0 if ffn["no_op"] else int(ffn["intermediate_size"])))
        return Architecture(
            hidden_size=raw["hidden_size"],
            num_attention_heads=raw["num_attention_heads"],
            head_dim=raw["head_dim"],
            vocab_size=raw["vocab_size"],
            tie_word_embeddings=raw["tie_word_embeddings"],
            blocks=tuple(blocks),
        )

    @staticmethod
    def from_llama_config(cfg: Any) -> Architecture:
        """The architecture of a (homogeneous) Hugging Face LlamaConfig."""
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return Architecture(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            blocks=tuple(Block(kv, cfg.intermediate_size) for _ in range(cfg.num_hidden_layers)),
        )


@dataclass(frozen=True)
class SearchSpace:
    """Discrete options per decision, each sorted ascending (the last one is the base model's).

    hidden: global hidden sizes; heads: global query-head counts (multiples of the base KV-head
    count, so every KV group keeps the same number of query heads and every KV option divides
    them); attention: KV-head counts (0 = no-op); ffn: intermediate sizes (0 = no-op). Every layer
    shares the attention and FFN option lists; `attention_floor[l]` is the lowest attention option
    layer l may take: layer 0 keeps its attention, because vLLM (0.32)
    cannot serve a DeciLM whose first computing layer has a no-op attention.
    """

    base: Architecture
    hidden: tuple[int, ...]
    attention: tuple[int, ...]
    ffn: tuple[int, ...]
    attention_floor: tuple[int, ...] = ()
    heads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.heads:
            object.__setattr__(self, "heads", (self.base.num_attention_heads,))
        if not self.attention_floor:
            first = 1 if self.attention[0] == 0 else 0
            object.__setattr__(self, "attention_floor", (first,) + (0,) * (self.base.num_layers - 1))

    @staticmethod
    def from_base(base: Architecture, spec: SpaceSpec) -> SearchSpace:
        if not base.is_homogeneous():
            raise ConfigError("the base model must be homogeneous (every layer the same shape)")
        d, blk = base.hidden_size, base.blocks[0]
        hidden = _grid(d, spec.hidden_divisor, spec.min_hidden_fraction, "search.space.hidden_divisor")
        ffn = _grid(blk.ffn, spec.ffn_divisor, spec.min_ffn_fraction, "search.space.ffn_divisor")
        kv = tuple(k for k in range(1, blk.kv_heads + 1) if blk.kv_heads % k == 0)
        attention = ((0,) if spec.allow_attention_noop else ()) + kv
        nq, groups = base.num_attention_heads, blk.kv_heads
        heads = tuple(range(groups, nq + 1, groups)) if spec.query_heads else (nq,)
        return SearchSpace(base, hidden, attention, ((0,) if spec.allow_ffn_noop else ()) + ffn, heads=heads)

    @property
    def num_layers(self) -> int:
        return self.base.num_layers

    def architecture(self, hidden: int, attention: list[int], ffn: list[int], heads: int | None = None) -> Architecture:
        """The architecture picked by option indices (one hidden and one query-head index, one per layer for the others).

        `heads` None = the base model's query heads (the last option).
        """
        blocks = tuple(Block(self.attention[a], self.ffn[f]) for a, f in zip(attention, ffn, strict=True))
        return Architecture(
            hidden_size=self.hidden[hidden],
            num_attention_heads=self.heads[len(self.heads) - 1 if heads is None else heads],
            head_dim=self.base.head_dim,
            vocab_size=self.base.vocab_size,
            tie_word_embeddings=self.base.tie_word_embeddings,
            blocks=blocks,
        )

    def homogeneous(
        self, hidden: int, kv_heads: int, ffn: int, dropped: set[int] | tuple[int, ...] = (), heads: int | None = None
    ) -> Architecture:
        """Every layer with `kv_heads` and `ffn`, the layers in `dropped` no-op whole; `heads` None = the base query heads."""
        blocks = tuple(Block(0, 0) if i in dropped else Block(kv_heads, ffn) for i in range(self.num_layers))
        nq = self.base.num_attention_heads if heads is None else heads
        return Architecture(**{**self.base.__dict__, "hidden_size": hidden, "num_attention_heads": nq, "blocks": blocks})

    def indices(self, arch: Architecture) -> tuple[int, list[int], list[int], int]:
        """Option indices (hidden, attention per layer, FFN per layer, query heads) of `arch`; ConfigError if not in this space."""
        try:
            return (
                self.hidden.index(arch.hidden_size),
                [self.attention.index(b.kv_heads) for b in arch.blocks],
                [self.ffn.index(b.ffn) for b in arch.blocks],
                self.heads.index(arch.num_attention_heads),
            )
        except ValueError as exc:
            raise ConfigError(f"architecture is not in the search space: {exc}") from exc

    def largest(self) -> Architecture:
        n = self.num_layers
        return self.architecture(len(self.hidden) - 1, [len(self.attention) - 1] * n, [len(self.ffn) - 1] * n)

    def smallest(self) -> Architecture:
        return self.architecture(0, list(self.attention_floor), [0] * self.num_layers, 0)

    def allows(self, arch: Architecture) -> bool:
        """Is `arch` in the space, floors included?"""
        try:
            _, att, _, _ = self.indices(arch)
        except ConfigError:
            return False
        return all(a >= f for a, f in zip(att, self.attention_floor, strict=True))

    def size(self) -> float:
        """Number of distinct architectures."""
        attention = [len(self.attention) - f for f in self.attention_floor]
        return len(self.hidden) * len(self.heads) * math.prod(float(a * len(self.ffn)) for a in attention)


def _grid(full: int, divisor: int, min_fraction: float, key: str) -> tuple[int, ...]:
    """Multiples of `divisor` from ceil(min_fraction * full) up to `full` (always included)."""
    if divisor > full:
        raise ConfigError(f"{key}={divisor} is larger than the base size {full}; use a smaller divisor")
    lo = min_fraction * full
    values = [m for m in range(divisor, full + 1, divisor) if m >= lo - 1e-9]
    if full not in values:
        values.append(full)
    return tuple(values)


def _largest_at_most(options: tuple[int, ...], value: float, floor: int) -> int:
    """Index of the largest option <= value, never below the first option >= floor."""
    allowed = [i for i, o in enumerate(options) if o >= floor]
    below = [i for i in allowed if options[i] <= value + 1e-9]
    return max(below) if below else min(allowed)


def uniform_shrink(space: SearchSpace, fraction: float) -> Architecture:
    """Every width (hidden, KV heads, FFN) at the largest option not above `fraction` of the base; no layer dropped."""
    base, n = space.base.blocks[0], space.num_layers
    h = _largest_at_most(space.hidden, fraction * space.base.hidden_size, 1)
    a = _largest_at_most(space.attention, fraction * base.kv_heads, 1)
    i = _largest_at_most(space.ffn, fraction * base.ffn, 1)
    return space.architecture(h, [a] * n, [i] * n)
