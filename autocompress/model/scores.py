"""What the search, the hybrid-MoE search and the held-out scores share: a language model's next-token NLL."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_nll(logp: torch.Tensor, ids: torch.Tensor) -> float:
    """Summed next-token negative log-likelihood of `ids` [b, s] under log-probabilities `logp` [b, s, V] (position t
    predicts token t + 1, so the last position predicts nothing)."""
    return -float(logp[:, :-1].gather(-1, ids[:, 1:, None]).sum())


def kl_of_log_probs(logp_s: torch.Tensor, logp_t: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) from log-probabilities [..., V]."""
    return F.kl_div(logp_s.flatten(0, -2), logp_t.flatten(0, -2), log_target=True, reduction="batchmean")
