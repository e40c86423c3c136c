import pytest
import torch

from metaclaw.losses import KLPenalty, kl_per_token

LOGPROBS = [[-1.0, -2.0]]
REF = torch.tensor([[-1.5, -1.0]])  # r = logprobs - ref = [0.5, -1.0]
MASK = torch.ones(1, 2)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", [0.5, -1.0]),  # r
        ("k2", [0.125, 0.5]),  # r^2 / 2
        ("k3", [0.106531, 0.718282]),  # exp(-0.5) - 1 + 0.5 = 0.606531 - 0.5; exp(1) - 1 - 1 = 0.718282
    ],
)
def test_estimators(estimator: str, expected: list[float]) -> None:
    assert kl_per_token(torch.tensor(LOGPROBS), REF, estimator).tolist()[0] == pytest.approx(expected, abs=1e-6)


def test_penalty_value_grad_and_metric() -> None:
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    out = KLPenalty(coef=0.1, estimator="k3", aggregation="token-mean")(logprobs, REF, MASK)
    out.loss.backward()
    # mean k3 = (0.106531 + 0.718282) / 2 = 0.412406; loss = 0.1 * 0.412406
    assert out.metrics["kl"].item() == pytest.approx(0.412406, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.0412406, abs=1e-6)
    # d k3 / dr = 1 - exp(-r) = [0.393469, -1.718282], times coef / 2 tokens = 0.05
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0196735, -0.0859141], abs=1e-6)


def test_zero_coef_and_masking() -> None:
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    ref = REF.clone()
    ref[0, 1] = float("-inf")  # off the mask: must not leak
    out = KLPenalty(coef=0.0)(logprobs, ref, torch.tensor([[1.0, 0.0]]))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert out.metrics["kl"].item() == pytest.approx(0.106531, abs=1e-6)  # only the first token
    assert torch.isfinite(logprobs.grad).all()


def test_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="k1, k2, k3"):
        KLPenalty(estimator="k4")
