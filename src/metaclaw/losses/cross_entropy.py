"""Weighted negative log-likelihood: supervised fine-tuning through the policy-loss signature."""

from __future__ import annotations

from torch import Tensor, nn

from metaclaw.losses.aggregation import aggregate, check_aggregation
from metaclaw.losses.base import LossOutput, check_same_shape, masked, masked_mean


class CrossEntropyLoss(nn.Module):
    """Supervised NLL of the target tokens (Tinker ``cross_entropy``).

    Objective per token: ℓ_t = −w_t · log π(a_t), where the weight w_t is the mask (Tinker's ``weights``, which
    may be fractional). ``behaviour_logprobs`` and ``advantages`` are ignored. With ``aggregation: sum`` the loss
    is Tinker's ``−Σ w_t log π(a_t)``.

    Args:
        aggregation: ``"token-mean"``, ``"seq-mean"`` or ``"sum"`` (see :func:`aggregate`).

    Metrics: ``nll_mean`` (mean −log π over weighted tokens).
    """

    def __init__(self, aggregation: str = "sum") -> None:
        super().__init__()
        self.aggregation = check_aggregation(aggregation)

    def forward(self, logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages, mask=mask)
        per_token = -masked(logprobs, mask)
        loss = aggregate(per_token, mask, self.aggregation)
        return LossOutput(loss=loss, metrics={"nll_mean": masked_mean(per_token.detach(), mask)})
