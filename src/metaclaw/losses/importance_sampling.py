"""Importance-sampling REINFORCE: the plain off-policy-corrected policy gradient."""

from __future__ import annotations

from torch import Tensor, nn

from metaclaw.losses.aggregation import aggregate, check_aggregation
from metaclaw.losses.base import LossOutput, check_same_shape, importance_ratio, masked, ratio_metrics


class ImportanceSamplingLoss(nn.Module):
    """Unclipped importance-sampling policy gradient (Tinker ``importance_sampling``).

    Objective per token: ℓ_t = −ρ_t · A_t with ρ_t = exp(log π(a_t) − log π_behaviour(a_t)),
    so ∂ℓ_t/∂log π(a_t) = −ρ_t · A_t. Reduced with ``aggregate(ℓ, mask, aggregation)``.

    Shapes: ``logprobs``, ``behaviour_logprobs``, ``advantages``, ``mask`` are all ``[B, T]``.

    Args:
        aggregation: ``"token-mean"``, ``"seq-mean"`` or ``"sum"`` (see :func:`aggregate`).
    """

    def __init__(self, aggregation: str = "token-mean") -> None:
        super().__init__()
        self.aggregation = check_aggregation(aggregation)

    def forward(self, logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages, mask=mask)
        ratio = importance_ratio(logprobs, behaviour_logprobs, mask)
        per_token = -ratio * masked(advantages, mask)
        loss = aggregate(per_token, mask, self.aggregation)
        return LossOutput(loss=loss, metrics=ratio_metrics(ratio, mask))
