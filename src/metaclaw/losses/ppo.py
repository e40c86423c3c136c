"""PPO clipped surrogate objective."""

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


class PPOLoss(nn.Module):
    """PPO clipped surrogate (Schulman et al., 2017; Tinker ``ppo``).

    Objective per token: ℓ_t = −min(ρ_t·A_t, clip(ρ_t, 1 − clip_low, 1 + clip_high)·A_t),
    ρ_t = exp(log π(a_t) − log π_behaviour(a_t)). Where the clipped branch is the minimum
    (A>0 and ρ>1+clip_high, or A<0 and ρ<1−clip_low) the token's gradient is zero; elsewhere
    ∂ℓ_t/∂log π(a_t) = −ρ_t·A_t.

    Shapes: ``logprobs``, ``behaviour_logprobs``, ``advantages``, ``mask`` are all ``[B, T]``.

    Args:
        clip_low: ε_low; Tinker fixes ε_low = ε_high = 0.2.
        clip_high: ε_high (values above 0.2 are DAPO's "clip-higher").
        aggregation: ``"token-mean"``, ``"seq-mean"`` or ``"sum"`` (see :func:`aggregate`).

    Metrics: ``clip_frac`` (share of masked tokens whose gradient the clip zeroes), ``ratio_mean``, ``ratio_max``.
    """

    def __init__(self, clip_low: float = 0.2, clip_high: float = 0.2, aggregation: str = "token-mean") -> None:
        super().__init__()
        if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low=}, {clip_high=}")
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.aggregation = check_aggregation(aggregation)

    def forward(self, logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages, mask=mask)
        ratio = importance_ratio(logprobs, behaviour_logprobs, mask)
        adv = masked(advantages, mask)
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        loss = aggregate(per_token, mask, self.aggregation)

        clip_active = ((adv > 0) & (ratio > 1.0 + self.clip_high)) | ((adv < 0) & (ratio < 1.0 - self.clip_low))
        metrics = {"clip_frac": masked_mean(clip_active.to(ratio.dtype), mask), **ratio_metrics(ratio, mask)}
        return LossOutput(loss=loss, metrics=metrics)
