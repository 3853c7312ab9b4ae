"""The model families AutoCompress prunes, named once, by the `model_type` their config.json carries (and the
`family` column of trials.parquet)."""

from __future__ import annotations

LLAMA = "llama"  # dense Llama-family models: the gradient search, Minitron, Puzzletron
HYBRID_MOE = "granitemoehybrid"  # hybrid Mamba-2 / attention / MoE (GraniteMoeHybrid): the exact search of search/moe.py
NEMOTRON_H = "nemotron_h"  # hybrid Mamba-2 / attention / MoE (Nemotron-H, Nemotron 3 Super): planned from its config
DECILM = "nemotron-nas"  # what a heterogeneous Llama export is (DeciLM / NemotronNAS block_configs)
