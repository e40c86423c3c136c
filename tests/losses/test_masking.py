"""Tokens off the mask contribute nothing to any loss: not to its value, not to its gradients."""

import pytest
import torch

from metaclaw.losses import CISPOLoss, ImportanceSamplingLoss, PPOLoss

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
LOSSES = [ImportanceSamplingLoss, PPOLoss, CISPOLoss]


def _run(loss_cls: type, aggregation: str, off_mask: float) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = torch.tensor([[-0.5, -1.2, -0.3], [-2.0, -0.7, -0.9]])
    behaviour = torch.tensor([[-0.6, -1.0, -0.4], [-1.5, -0.8, -1.0]])
    adv = torch.tensor([[1.0, -0.5, 2.0], [0.3, 1.0, -1.0]])
    off = MASK == 0
    logprobs = logprobs.masked_fill(off, off_mask).requires_grad_()
    behaviour = behaviour.masked_fill(off, -off_mask)
    adv = adv.masked_fill(off, off_mask)
    out = loss_cls(aggregation=aggregation)(logprobs, behaviour, adv, MASK)
    out.loss.backward()
    return out.loss.detach(), logprobs.grad


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean", "sum"])
@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize("off_mask", [50.0, float("inf"), float("nan")])
def test_masked_tokens_change_nothing(loss_cls: type, aggregation: str, off_mask: float) -> None:
    ref_loss, ref_grad = _run(loss_cls, aggregation, 0.0)
    loss, grad = _run(loss_cls, aggregation, off_mask)
    assert torch.isfinite(loss)
    assert torch.allclose(loss, ref_loss)
    assert torch.allclose(grad, ref_grad)
    assert torch.equal(grad[MASK == 0], torch.zeros(3))
