import math

import pytest
import torch

from metaclaw.losses import PPOLoss

RHO = [1.5, 0.5, 1.1, 1.5]
BEHAVIOUR = torch.full((1, 4), -2.0)
ADV = torch.tensor([[1.0, -1.0, 1.0, -2.0]])
MASK = torch.ones(1, 4)


def test_clipping_value_grad_and_clip_frac() -> None:
    logprobs = (BEHAVIOUR + torch.tensor([[math.log(r) for r in RHO]])).requires_grad_()
    out = PPOLoss(clip_low=0.2, clip_high=0.2, aggregation="sum")(logprobs, BEHAVIOUR, ADV, MASK)
    out.loss.backward()
    # t0: rho 1.5, A  1: min(1.5, 1.2)   = 1.2  clipped  -> -1.2, grad 0
    # t1: rho 0.5, A -1: min(-0.5, -0.8) = -0.8 clipped  ->  0.8, grad 0
    # t2: rho 1.1, A  1: inside the band = 1.1           -> -1.1, grad -rho*A = -1.1
    # t3: rho 1.5, A -2: min(-3.0, -2.4) = -3.0 unclipped ->  3.0, grad -rho*A = 3.0
    assert out.loss.item() == pytest.approx(-1.2 + 0.8 - 1.1 + 3.0)  # 1.5
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, 0.0, -1.1, 3.0])
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5)  # t0 and t1 of 4 tokens
    assert out.metrics["ratio_mean"].item() == pytest.approx(1.15)  # (1.5 + 0.5 + 1.1 + 1.5) / 4
    assert out.metrics["ratio_max"].item() == pytest.approx(1.5)


def test_asymmetric_clip_higher() -> None:
    # with clip_high 0.6 the t0 ratio 1.5 is inside the band: it keeps its gradient -rho*A = -1.5
    logprobs = (BEHAVIOUR + torch.tensor([[math.log(r) for r in RHO]])).requires_grad_()
    out = PPOLoss(clip_low=0.2, clip_high=0.6, aggregation="sum")(logprobs, BEHAVIOUR, ADV, MASK)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-1.5, 0.0, -1.1, 3.0])
    assert out.metrics["clip_frac"].item() == pytest.approx(0.25)


def test_bad_clip_rejected() -> None:
    with pytest.raises(ValueError, match="clip_low"):
        PPOLoss(clip_low=1.5)
