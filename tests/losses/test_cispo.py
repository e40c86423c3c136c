import math

import pytest
import torch

from metaclaw.losses import CISPOLoss

BEHAVIOUR = torch.full((1, 3), -2.0)
ADV = torch.tensor([[1.0, -1.0, 2.0]])
MASK = torch.ones(1, 3)


def _logprobs(rhos: list[float]) -> torch.Tensor:
    return (BEHAVIOUR + torch.tensor([[math.log(r) for r in rhos]])).requires_grad_()


def test_grad_flows_through_log_pi_only() -> None:
    # rho = [1.5, 0.5, 1.1]; clip to [0.8, 1.2] -> weights [1.2, 0.8, 1.1]
    logprobs = _logprobs([1.5, 0.5, 1.1])  # = [-1.594535, -2.693147, -1.904690]
    out = CISPOLoss(clip_low=0.2, clip_high=0.2, aggregation="sum")(logprobs, BEHAVIOUR, ADV, MASK)
    out.loss.backward()
    # loss = -(1.2 * -1.594535 * 1) - (0.8 * -2.693147 * -1) - (1.1 * -1.904690 * 2)
    #      = 1.913442 - 2.154518 + 4.190318 = 3.949242
    assert out.loss.item() == pytest.approx(3.949242, abs=1e-5)
    # grad = -clip(rho) * A = [-1.2, 0.8, -2.2]: clipped tokens keep a gradient (unlike PPO), and the unclipped
    # t2 has no extra d(rho) term (that would add -1.1 * -1.904690 * 2 = 4.190318)
    assert logprobs.grad.tolist()[0] == pytest.approx([-1.2, 0.8, -2.2])
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 3)


def test_default_is_tinker_one_sided_clip() -> None:
    loss = CISPOLoss()
    assert (1 - loss.clip_low, 1 + loss.clip_high) == (0.0, 4.0)  # Tinker clip_low/high_threshold
    # rho 4.5 is capped at 4.0; rho 0.1 is not raised (no lower bound)
    logprobs = _logprobs([4.5, 0.1, 1.0])
    out = loss(logprobs, BEHAVIOUR, ADV, MASK)
    out.loss.backward()
    # token-mean over 3: grad = -clip(rho) * A / 3 = [-4.0 * 1, -0.1 * -1, -1.0 * 2] / 3
    assert logprobs.grad.tolist()[0] == pytest.approx([-4.0 / 3, 0.1 / 3, -2.0 / 3])
    assert out.metrics["clip_frac"].item() == pytest.approx(1 / 3)
    assert out.metrics["ratio_max"].item() == pytest.approx(4.5)
