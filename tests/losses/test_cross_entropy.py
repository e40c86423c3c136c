"""CrossEntropyLoss (Tinker `cross_entropy`): −Σ w·log π over the weighted tokens, behaviour terms ignored."""

from __future__ import annotations

import pytest
import torch

from metaclaw.losses import CrossEntropyLoss


def test_weighted_nll_and_its_gradient() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, float("nan")]], requires_grad=True)
    weights = torch.tensor([[0.0, 1.0, 0.5], [1.0, 2.0, 0.0]])  # fractional weights; NaN padding off the mask
    junk = torch.full_like(weights, 7.0)  # behaviour logprobs / advantages play no part
    out = CrossEntropyLoss()(logprobs, junk, junk, weights)
    assert float(out.loss) == pytest.approx(2.0 + 1.5 + 0.5 + 8.0)
    out.loss.backward()
    assert torch.equal(logprobs.grad, -weights)
    mean = CrossEntropyLoss("token-mean")(logprobs.detach(), junk, junk, weights).loss
    assert float(mean) == pytest.approx(12.0 / 4.5)


def test_unknown_aggregation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown aggregation"):
        CrossEntropyLoss("mean")
