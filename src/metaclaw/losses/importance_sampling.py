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

    With ``max_ratio`` c the ratio is truncated (truncated importance sampling): ℓ_t = −sg(min(ρ_t, c)/ρ_t)·ρ_t·A_t,
    whose gradient is −min(ρ_t, c)·A_t; a token with ρ_t ≤ c (every on-policy token: ρ = 1) is unchanged. Samples
    from an adapter many versions behind (a trainer that ran ahead) carry large ratios: their weight is bounded.

    Args:
        aggregation: ``"token-mean"``, ``"seq-mean"`` or ``"sum"`` (see :func:`aggregate`).
        max_ratio: bound on the importance weight (> 1; 5 by default); None: unbounded (Tinker
            ``importance_sampling``, as the training server sets it).
    """

    def __init__(self, aggregation: str = "token-mean", max_ratio: float | None = 5.0) -> None:
        super().__init__()
        self.aggregation = check_aggregation(aggregation)
        if max_ratio is not None and max_ratio <= 1.0:
            raise ValueError(f"loss.max_ratio must be > 1 or null, got {max_ratio}")
        self.max_ratio = max_ratio

    def forward(self, logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages, mask=mask)
        ratio = importance_ratio(logprobs, behaviour_logprobs, mask)
        weight = ratio
        if self.max_ratio is not None:
            weight = ratio * (ratio.detach().clamp(max=self.max_ratio) / ratio.detach()).detach()
        per_token = -weight * masked(advantages, mask)
        loss = aggregate(per_token, mask, self.aggregation)
        metrics = ratio_metrics(ratio, mask)
        if self.max_ratio is not None:
            truncated = (ratio.detach() > self.max_ratio) & (mask > 0)
            metrics["ratio_truncated_frac"] = truncated.float().sum() / mask.sum()
        return LossOutput(loss=loss, metrics=metrics)
