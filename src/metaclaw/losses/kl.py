"""KL penalty towards the reference policy: the adapter the user is served (its anchor), or the base model."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from metaclaw.losses.aggregation import aggregate, check_aggregation
from metaclaw.losses.base import LossOutput, check_same_shape, masked_mean

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_REFERENCES = ("served", "base")


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from the sampled tokens' log-probs (Schulman, "Approximating KL").

    With r = log π(a) − log π_ref(a):  k1 = r;  k2 = r²/2;  k3 = exp(−r) − 1 + r  (unbiased, always ≥ 0).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


class KLPenalty(nn.Module):
    """KL(π‖π_ref) penalty: loss = coef · aggregate(kl_t, mask), kl_t from the k1/k2/k3 estimator.

    The caller computes ``ref_logprobs`` with the same model (no second copy): with ``reference="served"`` its
    adapter set to the one the user is served (`LoraPolicy.anchored`, kept current from the served pointer by
    `modules.anchor.ServedAnchor`; the base model until one is served), with ``"base"`` its adapter disabled.
    Why served by default: toward the base model, a preference once learnt is pulled back out whenever the rewards
    stop telling replies apart (a batch of thanks has advantage ~0, the KL term is then the whole gradient): the
    main job's candidates fell from ~90% back toward the base rate within 50 steps, recovered, and fell again
    (docs/learning.md "What the KL term pulls toward"). Toward the served adapter the same term holds the trainer
    near what the gate let through and what its samples came from (ProRL's reference reset, at each adapter the
    gate serves).

    Shapes: ``logprobs`` (with grad), ``ref_logprobs`` (no grad), ``mask`` are all ``[B, T]``.

    Args:
        coef: Penalty weight (0.1 by default); 0 keeps the metric but adds nothing to the gradient.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        aggregation: ``"token-mean"``, ``"seq-mean"`` or ``"sum"`` (see :func:`aggregate`).
        reference: ``"served"`` or ``"base"`` (above).

    Metrics: ``kl`` (token mean of the estimate over masked tokens).
    """

    def __init__(self, coef: float = 0.1, estimator: str = "k3", aggregation: str = "token-mean",
                 reference: str = "served") -> None:  # fmt: skip
        super().__init__()
        if estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
        if reference not in KL_REFERENCES:
            raise ValueError(f"unknown kl.reference {reference!r}; valid: {', '.join(KL_REFERENCES)}")
        self.coef = coef
        self.estimator = estimator
        self.aggregation = check_aggregation(aggregation)
        self.reference = reference

    def forward(self, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> LossOutput:
        check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
        on = mask > 0
        # zero log-ratio off the mask keeps padding (possibly ±inf/NaN) out of values and gradients
        ref = torch.where(on, ref_logprobs.detach(), logprobs.detach())
        kl = kl_per_token(logprobs, ref, self.estimator)
        loss = self.coef * aggregate(kl, mask, self.aggregation)
        return LossOutput(loss=loss, metrics={"kl": masked_mean(kl, mask)})
