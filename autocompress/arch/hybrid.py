"""Hybrid Mamba-2 / mixture-of-experts / attention models (Nemotron-H): a base model's shape, pruned shapes, their parameters.

A Nemotron-H model is a stack of single-mixer blocks named by one letter of its pattern:
`M` a Mamba-2 mixer, `E` a mixture of experts (routed experts in an optional latent width plus one
shared expert), `*` attention, `-` a dense MLP. A pruned shape keeps the global widths that the
Nemotron-H configuration can express (hidden size, query heads, Mamba heads, routed experts,
expert and shared-expert widths: one value for all layers, since that configuration has no
per-layer widths) and a number of blocks of each kind (depth). Widths are counted on arrays, so
one call prices a whole grid of shapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from autocompress.config.families import HYBRID_MOE, NEMOTRON_H
from autocompress.errors import ConfigError

KINDS = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
SSM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
WIDTHS = (
    "hidden_size",
    "num_attention_heads",
    "mamba_num_heads",
    "mamba_head_dim",
    "n_routed_experts",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "intermediate_size",
)
SHAPE_KEYS = (*WIDTHS, "mamba_layers", "moe_layers", "attention_layers", "mlp_layers")  # a shape: global widths and blocks kept per kind
LETTERS = {"mamba": "M", "linear_attention": "M", "moe": "E", "attention": "*", "full_attention": "*", "mlp": "-"}
LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias"}
# sizes a block of each kind uses (each must be > 0 when the pattern has that kind)
SIZES_OF = {
    "*": ("num_attention_heads", "num_key_value_heads", "head_dim"),
    "M": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"),
    "E": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "-": ("intermediate_size",),
}
# fields a model without blocks of that kind need not give
UNUSED_WITHOUT = {
    "E": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size"),
    "M": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"),
}


@dataclass(frozen=True)
class HybridModel:
    """The base model, in the field names of Hugging Face's `NemotronHConfig` (what its config.json holds)."""

    name: str
    hybrid_override_pattern: str
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None = None
    intermediate_size: int = 0  # dense MLP blocks ("-")
    mamba_ssm_cache_dtype: str = "float32"
    use_conv_bias: bool = True  # the Mamba convolution's bias
    use_bias: bool = False  # the Mamba in/out projections' biases
    mlp_bias: bool = False  # MLP, shared-expert and latent projections' biases
    gated_mlp: bool = False  # experts, shared expert and MLP blocks SiLU-gated (3 matrices, GraniteMoeHybrid) instead of relu^2 (2)
    source: str = ""  # where these numbers come from

    def __post_init__(self) -> None:
        bad = sorted(set(self.hybrid_override_pattern) - set(KINDS))
        if bad or not self.hybrid_override_pattern:
            raise ConfigError(f"architecture.hybrid_override_pattern holds {bad or 'nothing'}; use the letters {''.join(KINDS)}")
        if self.mamba_ssm_cache_dtype not in SSM_BYTES:
            raise ConfigError(
                f"architecture.mamba_ssm_cache_dtype={self.mamba_ssm_cache_dtype!r} is unknown; use one of {sorted(SSM_BYTES)}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("architecture.num_experts_per_tok must be <= n_routed_experts")
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Every size a block of the pattern uses is > 0 (a zero plans zero-width shapes), head counts divide."""
        pattern = self.hybrid_override_pattern
        keys = ["hidden_size", "vocab_size", *(k for letter, ks in SIZES_OF.items() if letter in pattern for k in ks)]
        for key in keys:
            if getattr(self, key) <= 0:
                raise ConfigError(f"architecture.{key}={getattr(self, key)!r} must be > 0 (the pattern has blocks that use it)")
        if "*" in self.hybrid_override_pattern and self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"architecture.num_key_value_heads={self.num_key_value_heads} does not divide "
                f"architecture.num_attention_heads={self.num_attention_heads}"
            )
        if "M" in self.hybrid_override_pattern and self.mamba_num_heads % self.n_groups:
            raise ConfigError(f"architecture.n_groups={self.n_groups} does not divide architecture.mamba_num_heads={self.mamba_num_heads}")

    @staticmethod
    def from_mapping(data: Mapping[str, Any], name: str = "") -> HybridModel:
        """From a Nemotron-H config.json (or the same fields in YAML); other keys of the file are ignored.

        Takes Hugging Face's names and their older aliases (layers_block_type, mamba_n_groups,
        mamba_d_conv, mamba_conv_bias) and its defaults for head_dim (128) and the biases.
        """
        data = dict(data)
        for old, new in LEGACY.items():
            if old in data and new not in data:
                data[new] = data.pop(old)
        if "hybrid_override_pattern" not in data and isinstance(data.get("layers_block_type"), list):
            data["hybrid_override_pattern"] = "".join(LETTERS.get(str(t), "?") for t in data["layers_block_type"])
        data.setdefault("head_dim", 128)
        for letter, keys in UNUSED_WITHOUT.items():
            if letter not in str(data.get("hybrid_override_pattern", letter)):
                data |= {k: data.get(k) or 0 for k in keys}
        known = {f.name: f for f in fields(HybridModel)}
        optional = {k for k, f in known.items() if f.default is not MISSING}
        missing = sorted(k for k in known if k not in optional and k != "name" and k not in data)
        if missing:
            raise ConfigError(f"the architecture lacks {', '.join(missing)}: is it a Nemotron-H (model_type nemotron_h) config?")
        kwargs = {k: v for k, v in data.items() if k in known}
        for key, value in kwargs.items():
            want = bool if known[key].type in ("bool",) else int if "int" in str(known[key].type) else None
            if want is int and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"architecture.{key}={value!r} must be a whole number >= 0")
            if want is bool and not isinstance(value, bool):
                raise ConfigError(f"architecture.{key}={value!r} must be true or false")
        kwargs["name"] = str(kwargs.get("name") or name or "hybrid")
        return HybridModel(**kwargs)

    @staticmethod
    def from_file(path: str | Path) -> HybridModel:
        """From a checkpoint folder's config.json or the file itself."""
        p = Path(path).expanduser()
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise ConfigError(f"architecture.path={path}: no such file (give a Nemotron-H config.json or the folder holding it)")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"architecture.path={path}: {p} is not a JSON config ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"architecture.path={path}: {p} holds no JSON object")
        if data.get("model_type") not in (None, NEMOTRON_H):
            raise ConfigError(
                f"architecture.path={path} is a {data.get('model_type')!r} model; the planner reads Nemotron-H (nemotron_h) configs"
            )
        return HybridModel.from_mapping(data, name=p.parent.name if p.name == "config.json" else p.stem)

    @staticmethod
    def from_granite(config: Any, name: str = "") -> HybridModel:
        """A GraniteMoeHybrid config (transformers object or dict) in Nemotron-H terms: each layer is a mixer block
        (`M` Mamba-2 or `*` attention) followed by an `E` block (routed plus shared SiLU-gated experts)."""
        c = config if isinstance(config, Mapping) else config.to_dict()
        letter = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*"}
        pattern = "".join(letter[str(t)] + "E" for t in c["layer_types"])
        if c.get("num_local_experts", 0) < 1:
            raise ConfigError("the GraniteMoeHybrid model has no routed experts (num_local_experts=0); prune it as a dense model")
        return HybridModel(
            name=name or str(c.get("_name_or_path") or HYBRID_MOE),
            hybrid_override_pattern=pattern,
            hidden_size=c["hidden_size"],
            vocab_size=c["vocab_size"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c["hidden_size"] // c["num_attention_heads"],
            mamba_num_heads=c["mamba_n_heads"],
            mamba_head_dim=c["mamba_d_head"],
            ssm_state_size=c["mamba_d_state"],
            n_groups=c["mamba_n_groups"],
            conv_kernel=c["mamba_d_conv"],
            n_routed_experts=c["num_local_experts"],
            num_experts_per_tok=c["num_experts_per_tok"],
            moe_intermediate_size=c["intermediate_size"],
            moe_shared_expert_intermediate_size=c["shared_intermediate_size"],
            use_conv_bias=bool(c.get("mamba_conv_bias", True)),
            use_bias=bool(c.get("mamba_proj_bias", False)),
            gated_mlp=True,
            source="GraniteMoeHybrid config",
        )

    def count(self, kind: str) -> int:
        """Blocks of one kind ("mamba", "moe", "attention", "mlp")."""
        return sum(KINDS[c] == kind for c in self.hybrid_override_pattern)

    def base_shape(self) -> dict[str, np.ndarray]:
        """The unpruned model as a one-row shape."""
        shape = {k: np.array([getattr(self, k)]) for k in WIDTHS}
        return shape | {f"{kind}_layers": np.array([self.count(kind)]) for kind in ("mamba", "moe", "attention", "mlp")}


def parameters(model: HybridModel, s: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Parameters of a shape by part, `total`, and `active` (those one token uses), as Hugging Face's NemotronH builds them.

    h hidden, V vocab, per block a norm h plus its mixer:
      mamba:     in_proj h*(2*di + 2*g*N + nh), conv1d (di + 2*g*N)*(K + conv bias), dt_bias/A_log/D 3*nh,
                 norm di, out_proj di*h (+ their biases with use_bias); di = nh * mamba_head_dim
      attention: q and o 2*h*(nq*hd), k and v 2*h*(nkv*hd)
      moe:       router E*h, routed experts E * 2*f*l (up and down, no gate; l = latent width, else h),
                 latent projections 2*h*l (when latent), shared expert 2*h*s (+ biases with mlp_bias)
      mlp:       2*h*i (up and down, no gate; + biases with mlp_bias)
    With gated_mlp (GraniteMoeHybrid) experts, shared expert and MLP have a gate too: 3 matrices, not 2.
    embedding V*h (+ untied LM head V*h), final norm h. Active: k of the E routed experts.
    """
    h = s["hidden_size"].astype(np.float64)
    nh = s["mamba_num_heads"]
    di = nh * s["mamba_head_dim"]
    gn = 2 * model.n_groups * model.ssm_state_size
    mamba = h * (2 * di + gn + nh) + (di + gn) * (model.conv_kernel + model.use_conv_bias) + 3 * nh + di + di * h + h
    mamba = mamba + model.use_bias * (2 * di + gn + nh + h)
    q, kv = s["num_attention_heads"] * model.head_dim, model.num_key_value_heads * model.head_dim
    attention = 2 * h * q + 2 * h * kv + h
    experts, f = s["n_routed_experts"], s["moe_intermediate_size"]
    latent = model.moe_latent_size or h
    mats = 3.0 if model.gated_mlp else 2.0  # gate, up, down (gated) or up, down
    expert = mats * f * latent
    shared = s["moe_shared_expert_intermediate_size"]
    latent_proj = (2 * h * latent + model.mlp_bias * (latent + h)) if model.moe_latent_size else 0
    moe_fixed = experts * h + latent_proj + mats * h * shared + model.mlp_bias * (shared + h) + h
    mlp = mats * h * s["intermediate_size"] + model.mlp_bias * (s["intermediate_size"] + h) + h
    embed = model.vocab_size * h * (1 if model.tie_word_embeddings else 2) + h
    parts = {
        "embedding": embed,
        "mamba": s["mamba_layers"] * mamba,
        "attention": s["attention_layers"] * attention,
        "moe_routed": s["moe_layers"] * experts * expert,
        "moe_other": s["moe_layers"] * moe_fixed,
        "mlp": s["mlp_layers"] * mlp,
    }
    total = sum(parts.values())
    active = total - s["moe_layers"] * (experts - model.num_experts_per_tok) * expert
    return parts | {"total": total, "active": active}


def shape_config(model: HybridModel, shape: Mapping[str, Any]) -> dict[str, Any]:
    """A Nemotron-H config (Hugging Face field names) for one shape, blocks of each kind dropped from the end of the stack.

    Which blocks to drop needs the weights (block importance on calibration text); without them the
    last blocks of each kind go, and the parameter count is the same whichever ones go.
    """
    keep = {kind: int(shape[f"{kind}_layers"]) for kind in ("mamba", "moe", "attention", "mlp")}
    kept: list[str] = []
    seen = dict.fromkeys(keep, 0)
    for letter in model.hybrid_override_pattern:
        kind = KINDS[letter]
        if seen[kind] < keep[kind]:
            kept.append(letter)
        seen[kind] += 1
    out = {f.name: getattr(model, f.name) for f in fields(model) if f.name not in ("name", "source", "gated_mlp")}
    out |= {k: int(shape[k]) for k in WIDTHS}
    out |= {"hybrid_override_pattern": "".join(kept), "num_hidden_layers": len(kept), "model_type": NEMOTRON_H}
    return out


def write_config(model: HybridModel, shape: Mapping[str, Any], out: Path, dtype: str = "bfloat16") -> Path:
    """A weight-free Nemotron-H checkpoint of one shape (config.json only).

    transformers builds the model from it; vLLM serves it with load_format="dummy" (measurements).
    """
    config = shape_config(model, shape) | {
        "architectures": ["NemotronHForCausalLM"],
        "torch_dtype": dtype,
        "num_nextn_predict_layers": 0,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
