import pytest
import torch

from metaclaw.advantages import RLAdvantage

NAN = float("nan")
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
REWARD = torch.tensor([2.0, 0.0, 1.0])


@pytest.mark.parametrize(
    ("normalize", "per_sample"),
    [
        ("none", [2.0, 0.0, 1.0]),
        ("mean", [1.0, -1.0, 0.0]),  # mean 1
        # population std = sqrt((1 + 1 + 0) / 3) = 0.816497; 1 / 0.816497 = 1.224745
        ("mean_std", [1.224745, -1.224745, 0.0]),
    ],
)
def test_broadcast_and_normalisation(normalize: str, per_sample: list[float]) -> None:
    adv, metrics = RLAdvantage(normalize=normalize, eps=0.0)({"mask": MASK, "reward": REWARD})
    a, b, c = per_sample
    expected = torch.tensor([[a, a, 0.0], [b, 0.0, 0.0], [c, c, c]])  # zero off the mask
    assert torch.allclose(adv, expected, atol=1e-6)
    assert metrics["reward_mean"].item() == pytest.approx(1.0)


def test_missing_reward_rejected() -> None:
    with pytest.raises(ValueError, match=r"\[1\]"):
        RLAdvantage()({"mask": MASK, "reward": torch.tensor([1.0, NAN, 0.0])})


def test_unknown_normalize() -> None:
    with pytest.raises(ValueError, match="none, mean, mean_std"):
        RLAdvantage(normalize="std")
