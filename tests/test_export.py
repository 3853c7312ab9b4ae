"""Exported checkpoints load in transformers (and vLLM) and compute what the masked model computed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from autocompress.arch import Architecture, Block, SearchSpace
from autocompress.decilm import parameter_shapes, write_checkpoint
from autocompress.errors import ConfigError
from autocompress.export import pruned_state_dict
from autocompress.importance import rank_units
from autocompress.masking import MaskedModel, Ranking


def hetero(space: SearchSpace, hidden: int, *blocks: Block) -> Architecture:
    return Architecture(**{**space.base.__dict__, "hidden_size": hidden, "blocks": blocks})


def masked_forward(model: Any, space: SearchSpace, ranking: Ranking, arch: Architecture, ids: torch.Tensor, new: int = 0) -> torch.Tensor:
    """Logits [b, s, V] of the hooked model at `arch`, or (new > 0) its greedy continuation [b, s + new]."""
    masked = MaskedModel(model, space, ranking)
    try:
        masked.set_architecture(arch)
        with torch.no_grad():
            if new:
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
            return model(ids).logits
    finally:
        masked.remove()


def test_weight_free_checkpoint_has_config_and_code(tiny_model: Any, tiny_space: SearchSpace, tmp_path: Path) -> None:
    arch = hetero(tiny_space, 48, Block(1, 64), Block(0, 96), Block(2, 0))
    out = write_checkpoint(arch, tmp_path / "ck", tiny_model.config)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "configuration_decilm.py", "modeling_decilm.py"]
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DeciLMForCausalLM"] and raw["model_type"] == "nemotron-nas"
    assert raw["auto_map"]["AutoModelForCausalLM"] == "modeling_decilm.DeciLMForCausalLM"
    assert "replace_with_linear" not in json.dumps(raw["block_configs"])
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    # what vLLM's nemotron_nas.py reads: attribute access, intermediate_size (no ffn_mult)
    assert [b.attention.no_op for b in config.block_configs] == [False, True, False]
    assert config.block_configs[2].attention.n_heads_in_group == 2 and config.block_configs[0].ffn.intermediate_size == 64
    assert not hasattr(config.block_configs[0].ffn, "ffn_mult")
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"} == parameter_shapes(arch)
    assert sum(p.numel() for p in model.parameters()) == arch.num_params()


def test_write_checkpoint_refuses_bad_input(tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor, tmp_path: Path) -> None:
    arch = hetero(tiny_space, 48, Block(1, 64), Block(0, 96), Block(2, 0))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not an empty folder"):
        write_checkpoint(arch, tmp_path / "full", tiny_model.config)
    state = pruned_state_dict(tiny_model, arch, rank_units(tiny_model, tokens, progress=False))
    state["model.norm.weight"] = state["model.norm.weight"][:10]
    with pytest.raises(ConfigError, match=r"model\.norm\.weight has shape \(10,\), expected \(48,\)"):
        write_checkpoint(arch, tmp_path / "bad", tiny_model.config, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing half-written


ARCHS = {
    "mixed": (48, Block(1, 64), Block(0, 96), Block(2, 0)),
    "first_attention_noop": (32, Block(0, 32), Block(1, 96), Block(2, 64)),
    "all_noop": (32, Block(0, 0), Block(0, 0), Block(0, 0)),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_decilm_checkpoint_equals_masked_model(
    tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor, tmp_path: Path, name: str
) -> None:
    ranking = rank_units(tiny_model, tokens, progress=False)
    arch = hetero(tiny_space, *ARCHS[name])
    out = write_checkpoint(arch, tmp_path / "ck", tiny_model.config, pruned_state_dict(tiny_model, arch, ranking))
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(exported).__name__ == "DeciLMForCausalLM"
    with torch.no_grad():
        logits = exported(tokens).logits
    expected = masked_forward(tiny_model, tiny_space, ranking, arch, tokens)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    prompts = tokens[:, :6]
    with torch.no_grad():
        generated = exported.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False)
    assert torch.equal(generated, masked_forward(tiny_model, tiny_space, ranking, arch, prompts, new=8))
