"""Fidelity measures between two next-token distributions."""

from __future__ import annotations

import torch


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of the softmax distributions of two logit vectors (vocab,)."""
    lp, lq = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((lp.exp() * (lp - lq)).sum())
