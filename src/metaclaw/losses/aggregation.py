"""Reduce a per-token loss ``[B, T]`` to a scalar; kept apart from the objectives, as in verl."""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATION_MODES = ("token-mean", "seq-mean", "sum")


def check_aggregation(mode: str) -> str:
    """Return ``mode`` if it is a known aggregation mode, else raise ValueError listing the valid ones."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation {mode!r}; valid modes: {', '.join(AGGREGATION_MODES)}")
    return mode


def aggregate(per_token: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Aggregate a masked per-token quantity into a scalar.

    Args:
        per_token: ``[B, T]`` values (e.g. −ρ·A per token).
        mask: ``[B, T]`` 1.0 on trained tokens, 0.0 elsewhere; off-mask values are ignored even if NaN.
        mode: ``"token-mean"``: Σ masked / #masked tokens in the batch (long answers weigh more);
            ``"seq-mean"``: mean over sequences of each sequence's masked token mean, sequences with no
            masked token skipped (every answer weighs the same); ``"sum"``: plain masked sum (Tinker parity).

    Returns:
        Scalar tensor; 0 (still in the graph) when the mask is empty.
    """
    check_aggregation(mode)
    if per_token.shape != mask.shape:
        raise ValueError(f"shape mismatch: per_token{tuple(per_token.shape)} vs mask{tuple(mask.shape)}")
    weight = torch.where(mask > 0, mask, torch.zeros_like(mask))
    weighted = torch.where(mask > 0, per_token * mask, torch.zeros_like(per_token))
    if mode == "sum":
        return weighted.sum()
    if mode == "token-mean":
        # an empty mask gives 0 / tiny = 0 instead of 0 / 0
        return weighted.sum() / weight.sum().clamp(min=torch.finfo(weight.dtype).tiny)
    seq_weight = weight.sum(dim=-1)
    has_tokens = seq_weight > 0
    if not bool(has_tokens.any()):
        return weighted.sum()
    return (weighted.sum(dim=-1)[has_tokens] / seq_weight[has_tokens]).mean()
