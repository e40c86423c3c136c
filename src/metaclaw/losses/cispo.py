"""CISPO: clipped importance-sampling weight policy optimisation."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from metaclaw.losses.aggregation import aggregate, check_aggregation
from metaclaw.losses.base import (
    LossOutput,
    check_same_shape,
    importance_ratio,
    masked,
    masked_mean,
    ratio_metrics,
)


class CISPOLoss(nn.Module):
    """CISPO (MiniMax-M1, arXiv:2506.13585; Tinker ``cispo``).

    Objective per token: ℓ_t = −sg(clip(ρ_t, 1 − clip_low, 1 + clip_high)) · log π(a_t) · A_t,
    ρ_t = exp(log π(a_t) − log π_behaviour(a_t)), sg = stop-gradient. The clipped ratio is only a
    coefficient, so ∂ℓ_t/∂log π(a_t) = −clip(ρ_t)·A_t: unlike PPO no token's gradient is ever zeroed,
    the clip only bounds its size.

    Defaults: Tinker's CISPO docs default to a one-sided clip with absolute thresholds
    ``clip_low_threshold=0.0, clip_high_threshold=4.0`` (MiniMax-M1 also sets no lower bound and tunes
    only the upper one). In this class's ε form that is ``clip_low=1.0`` (1 − 1.0 = 0) and ``clip_high=3.0``.

    Shapes: ``logprobs``, ``behaviour_logprobs``, ``advantages``, ``mask`` are all ``[B, T]``.

    Args:
        clip_low: ε_low; the ratio is clipped below at 1 − clip_low (1.0 disables the lower bound).
        clip_high: ε_high; the ratio is clipped above at 1 + clip_high.
        aggregation: ``"token-mean"``, ``"seq-mean"`` or ``"sum"`` (see :func:`aggregate`).

    Metrics: ``clip_frac`` (share of masked tokens whose ratio was clipped), ``ratio_mean``, ``ratio_max``.
    """

    def __init__(self, clip_low: float = 1.0, clip_high: float = 3.0, aggregation: str = "token-mean") -> None:
        super().__init__()
        if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low=}, {clip_high=}")
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.aggregation = check_aggregation(aggregation)

    def forward(self, logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages, mask=mask)
        ratio = importance_ratio(logprobs, behaviour_logprobs, mask).detach()
        weight = torch.clamp(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)
        per_token = -weight * masked(logprobs, mask) * masked(advantages, mask)
        loss = aggregate(per_token, mask, self.aggregation)

        clipped = (ratio < 1.0 - self.clip_low) | (ratio > 1.0 + self.clip_high)
        metrics = {"clip_frac": masked_mean(clipped.to(ratio.dtype), mask), **ratio_metrics(ratio, mask)}
        return LossOutput(loss=loss, metrics=metrics)
