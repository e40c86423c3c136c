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


def test_shape_mismatch_names_tensors() -> None:
    with pytest.raises(ValueError, match="advantages"):
        ImportanceSamplingLoss()(_logprobs(), BEHAVIOUR, torch.zeros(1, 3), MASK)
