"""Architecture counts against hand-computed values and against real modules."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import LlamaConfig

from autocompress.arch.space import Architecture, Block, SearchSpace
from autocompress.config.schema import SpaceSpec
from autocompress.errors import ConfigError

SMOLLM2 = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
)


def hetero() -> Architecture:
    return Architecture(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=True,
        blocks=(Block(2, 96), Block(0, 32), Block(1, 0)),
    )


def test_smollm2_parameter_count() -> None:
    assert Architecture.from_llama_config(SMOLLM2).num_params() == 134_515_008


def test_tiny_parameter_count_matches_module(tiny_model: Any) -> None:
    arch = Architecture.from_llama_config(tiny_model.config)
    assert arch.num_params() == sum(p.numel() for p in tiny_model.parameters())


def test_untied_head_counts_twice() -> None:
    tied = hetero()
    untied = Architecture(**{**tied.__dict__, "tie_word_embeddings": False})
    assert untied.num_params() - tied.num_params() == 256 * 64


def test_heterogeneous_counts_by_hand() -> None:
    arch = hetero()
    # embedding 256*64 + final norm 64
    # layer 0: attn 64 + 2*64*64 + 2*64*2*16 = 12352, ffn 64 + 3*64*96 = 18496
    # layer 1: ffn 64 + 3*64*32 = 6208; layer 2: attn 64 + 8192 + 2*64*16 = 10304
    assert arch.num_params() == 16384 + 64 + 12352 + 18496 + 6208 + 10304
    assert arch.kv_bytes_per_token(2) == 2 * (2 + 0 + 1) * 16 * 2
    # 2*d*V + layer0 (2*(8192+4096) + 4*64*10 + 2*3*64*96) + layer1 (2*3*64*32) + layer2 (2*(8192+2048) + 2560)
    assert arch.flops_per_token(context=10) == 32768 + 27136 + 36864 + 12288 + 23040


def test_block_configs_round_trip() -> None:
    arch = hetero()
    configs = arch.block_configs()
    assert configs[0]["attention"] == {"no_op": False, "replace_with_linear": False, "n_heads_in_group": 2}
    assert configs[1]["attention"]["no_op"] is True
    assert configs[2]["ffn"] == {"no_op": True, "replace_with_linear": False, "intermediate_size": None}
    assert Architecture.from_json(arch.to_json()) == arch
    assert not arch.is_homogeneous()


def test_space_options_and_extremes() -> None:
    space = SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec())
    assert space.hidden == (320, 384, 448, 512, 576)
    assert space.attention == (0, 1, 3)  # no-op, or a divisor of the 3 KV heads
    assert space.ffn[0] == 0 and space.ffn[-1] == 1536 and all(f % 128 == 0 for f in space.ffn)
    assert space.largest() == Architecture.from_llama_config(SMOLLM2)
    smallest = space.smallest()
    assert smallest.hidden_size == 320 and smallest.blocks[0] == Block(1, 0) and all(b == Block(0, 0) for b in smallest.blocks[1:])
    assert space.heads == (3, 6, 9)  # whole query heads per KV group: 1, 2 or 3 of each group's 3
    assert smallest.num_attention_heads == 3
    assert space.indices(space.largest()) == (4, [2] * 30, [len(space.ffn) - 1] * 30, 2)


def test_query_head_axis_can_be_switched_off() -> None:
    space = SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec(query_heads=False))
    assert space.heads == (9,) and space.smallest().num_attention_heads == 9


def test_space_without_noops() -> None:
    space = SearchSpace.from_base(
        hetero_base(), SpaceSpec(allow_attention_noop=False, allow_ffn_noop=False, ffn_divisor=32, hidden_divisor=16)
    )
    assert 0 not in space.attention and 0 not in space.ffn


def hetero_base() -> Architecture:
    return Architecture(
        hidden_size=64, num_attention_heads=4, head_dim=16, vocab_size=256, tie_word_embeddings=True, blocks=(Block(2, 96),) * 3
    )


def test_divisor_larger_than_base_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="ffn_divisor"):
        SearchSpace.from_base(hetero_base(), SpaceSpec(ffn_divisor=1024))


def test_architecture_outside_space_is_rejected() -> None:
    space = SearchSpace.from_base(hetero_base(), SpaceSpec(hidden_divisor=16, ffn_divisor=32))
    with pytest.raises(ConfigError, match="not in the search space"):
        space.indices(Architecture(**{**hetero_base().__dict__, "hidden_size": 50}))


def test_first_layer_keeps_its_attention() -> None:
    """vLLM 0.32 cannot serve a DeciLM whose first computing layer has a no-op attention."""
    space = SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec())
    assert space.attention_floor == (1,) + (0,) * 29
    assert space.smallest().blocks[0].kv_heads == 1 and space.allows(space.smallest())
    n = space.num_layers
    assert not space.allows(space.architecture(4, [0] + [2] * (n - 1), [3] * n))
    assert space.allows(space.architecture(4, [2] + [0] * (n - 1), [3] * n))
