"""DeciLM (nemotron-nas) configuration: one global hidden size, per-layer `block_configs`.

Self-contained (imports only transformers): copied into every exported checkpoint and loaded with
`trust_remote_code=True` by transformers and vLLM. Each `block_configs` entry reads as attributes
(`block_configs[i].attention.n_heads_in_group`, `.ffn.intermediate_size`), as vLLM's
`nemotron_nas.py` expects, and serialises as plain JSON.
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import PretrainedConfig


class AttrDict(dict[str, Any]):
    """A JSON-able dict whose keys also read as attributes (missing key -> AttributeError, so hasattr works)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def block_config(raw: dict[str, Any]) -> AttrDict:
    """One layer: {"attention": {"no_op", "n_heads_in_group"}, "ffn": {"no_op", "intermediate_size"}}."""
    return AttrDict({key: AttrDict(value) if isinstance(value, dict) else value for key, value in raw.items()})


class DeciLMConfig(PretrainedConfig):
    """A Llama-family decoder whose layers differ: KV heads or no-op attention, FFN width or no-op FFN."""

    model_type = "nemotron-nas"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    head_dim: int | None = None
    block_configs: list[Any] | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.block_configs is None:
            self.block_configs = [{"attention": {"no_op": False, "n_heads_in_group": 1}, "ffn": {"no_op": False}}]
            self.block_configs *= self.num_hidden_layers
        self.block_configs = [block_config(dict(b)) for b in self.block_configs]
        if len(self.block_configs) != self.num_hidden_layers:
            raise ValueError(f"block_configs has {len(self.block_configs)} entries for num_hidden_layers={self.num_hidden_layers}")
        super().__post_init__(**kwargs)

    def num_kv_heads(self, layer_idx: int) -> int:
        """KV heads of layer `layer_idx` (0 for a no-op attention)."""
        attention = self.block_configs[layer_idx].attention  # type: ignore[index]
        return 0 if attention.no_op else self.num_attention_heads // attention.n_heads_in_group


__all__ = ["DeciLMConfig"]
