import math

import pytest
import torch

from metaclaw.losses import ImportanceSamplingLoss

BEHAVIOUR = torch.tensor([[-1.0, -1.0]])
ADV = torch.tensor([[2.0, 0.5]])
MASK = torch.ones(1, 2)


def _logprobs() -> torch.Tensor:
    # rho = exp(logprobs - behaviour) = [1, 2]
    return torch.tensor([[-1.0, -1.0 + math.log(2.0)]], requires_grad=True)


@pytest.mark.parametrize(
    ("aggregation", "loss", "grad"),
    [
        # per token -rho*A = [-1*2, -2*0.5] = [-2, -1]; d/dlogpi(-rho*A) = -rho*A
        ("sum", -3.0, [-2.0, -1.0]),
        ("token-mean", -1.5, [-1.0, -0.5]),  # divided by 2 tokens
    ],
)
def test_value_and_grad(aggregation: str, loss: float, grad: list[float]) -> None:
    logprobs = _logprobs()
    out = ImportanceSamplingLoss(aggregation=aggregation)(logprobs, BEHAVIOUR, ADV, MASK)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(loss)
    assert logprobs.grad.tolist()[0] == pytest.approx(grad)
    assert out.metrics["ratio_mean"].item() == pytest.approx(1.5)  # (1 + 2) / 2
    assert out.metrics["ratio_max"].item() == pytest.approx(2.0)
    assert out.metrics["ratio_min"].item() == pytest.approx(1.0)


def test_shape_mismatch_names_tensors() -> None:
    with pytest.raises(ValueError, match="advantages"):
        ImportanceSamplingLoss()(_logprobs(), BEHAVIOUR, torch.zeros(1, 3), MASK)


def test_truncated_ratio_leaves_on_policy_data_alone_and_bounds_stale_tokens():
    """Issue 42: with `max_ratio` the importance weight is bounded (stale samples of a trainer that ran ahead);
    on-policy (ratio exactly 1) the loss and its gradient are those of the unbounded loss."""
    import torch

    from metaclaw.losses.importance_sampling import ImportanceSamplingLoss

    mask = torch.ones(2, 3)
    adv = torch.tensor([[1.0, -1.0, 0.5], [2.0, 1.0, -0.5]])
    behaviour = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.4, 0.1, 0.6]]))
    grads = []
    for loss_fn in (ImportanceSamplingLoss(), ImportanceSamplingLoss(max_ratio=2.0)):
        lp = behaviour.clone().requires_grad_(True)  # on-policy: ratio 1
        out = loss_fn(lp, behaviour, adv, mask)
        out.loss.backward()
        grads.append((out.loss.detach(), lp.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    lp = (behaviour + torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])).requires_grad_(True)  # one ratio e^3 ≈ 20
    out = ImportanceSamplingLoss(max_ratio=2.0)(lp, behaviour, adv, mask)
    out.loss.backward()
    assert torch.isclose(lp.grad[0, 0], torch.tensor(-2.0 * 1.0 / 6))  # -min(ρ, 2)·A / tokens
    assert out.metrics["ratio_truncated_frac"] == 1 / 6
