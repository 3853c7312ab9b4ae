"""DeciLM (nemotron-nas) decoder for transformers: Llama layers whose attention and FFN differ per layer or are no-ops.

Self-contained (imports only torch and transformers): copied into every exported checkpoint and
loaded with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`. Parameter names are
Llama's (`model.layers.{i}.self_attn.q_proj.weight`, ...), which vLLM's `DeciLMForCausalLM` also
reads; a no-op block has no parameters. Only kept attention layers hold a KV cache, indexed in
order (as vLLM does), so the cache's first layer always has the sequence length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb, eager_attention_forward

from .configuration_decilm import DeciLMConfig


class DeciLMMLP(nn.Module):
    """SwiGLU FFN of one layer's own width: down(act(gate(x)) * up(x))."""

    def __init__(self, config: DeciLMConfig, intermediate_size: int) -> None:
        super().__init__()
        d, bias = config.hidden_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(d, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, d, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeciLMAttention(nn.Module):
    """Grouped-query attention with this layer's KV heads; all query heads kept; `cache_idx` = its KV-cache slot."""

    def __init__(self, config: DeciLMConfig, num_kv_heads: int, cache_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = cache_idx  # the name transformers' attention functions and caches read
        self.head_dim: int = config.head_dim  # type: ignore[assignment]
        self.num_key_value_groups = config.num_attention_heads // num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        d, q, kv, bias = config.hidden_size, config.num_attention_heads * self.head_dim, num_kv_heads * self.head_dim, config.attention_bias
        self.q_proj = nn.Linear(d, q, bias=bias)
        self.k_proj = nn.Linear(d, kv, bias=bias)
        self.v_proj = nn.Linear(d, kv, bias=bias)
        self.o_proj = nn.Linear(q, d, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [b, s, d]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [b, nq, s, hd]
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [b, kv, s, hd]
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        interface: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        dropout = self.attention_dropout if self.training else 0.0
        out, _ = interface(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())


class DeciLMDecoderLayer(nn.Module):
    """x + attention(norm(x)) unless attention is a no-op, then x + mlp(norm(x)) unless the FFN is a no-op."""

    def __init__(self, config: DeciLMConfig, layer_idx: int, cache_idx: int) -> None:
        super().__init__()
        block = config.block_configs[layer_idx]  # type: ignore[index]
        self.input_layernorm: LlamaRMSNorm | None = None
        self.self_attn: DeciLMAttention | None = None
        self.post_attention_layernorm: LlamaRMSNorm | None = None
        self.mlp: DeciLMMLP | None = None
        if not block.attention.no_op:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.self_attn = DeciLMAttention(config, config.num_kv_heads(layer_idx), cache_idx)
        if not block.ffn.no_op:
            self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = DeciLMMLP(config, int(block.ffn.intermediate_size))

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.self_attn is not None and self.input_layernorm is not None:
            hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), **kwargs)
        if self.mlp is not None and self.post_attention_layernorm is not None:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class DeciLMPreTrainedModel(PreTrainedModel):
    """Shared settings: config class, weight init, attention backends."""

    config_class = DeciLMConfig
    config: DeciLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["DeciLMDecoderLayer"]  # noqa: RUF012 (transformers reads these class attributes)
    _skip_keys_device_placement = ["past_key_values"]  # noqa: RUF012
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True


class DeciLMModel(DeciLMPreTrainedModel):
    """Embedding -> heterogeneous decoder layers -> final norm."""

    def __init__(self, config: DeciLMConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        kept = [not config.block_configs[i].attention.no_op for i in range(config.num_hidden_layers)]  # type: ignore[index]
        cache_idx = [sum(kept[:i]) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList([DeciLMDecoderLayer(config, i, cache_idx[i]) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)  # type: ignore[arg-type]
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # [b, s, d]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)  # type: ignore[assignment]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden = inputs_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=past_key_values)


class DeciLMForCausalLM(DeciLMPreTrainedModel, GenerationMixin):
    """DeciLMModel + LM head (tied to the embedding when `tie_word_embeddings`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # noqa: RUF012

    def __init__(self, config: DeciLMConfig) -> None:
        super().__init__(config)
        self.model = DeciLMModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # The model's parameters are spelled out again rather than passed as **kwargs: transformers' generate
    # reads this signature (attention_mask, position_ids, logits_to_keep) to decide what to pass.
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        kwargs.pop("return_dict", None)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(out.last_hidden_state[:, keep, :])  # [b, s, V]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


__all__ = ["DeciLMForCausalLM", "DeciLMModel", "DeciLMPreTrainedModel"]
