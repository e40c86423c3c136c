import pytest
import torch

from metaclaw.advantages import OPDAdvantage

NAN = float("nan")


def test_per_token_teacher_minus_student() -> None:
    batch = {
        "mask": torch.tensor([[1.0, 1.0, 0.0]]),
        "behaviour_logprobs": torch.tensor([[-1.0, -0.5, -3.0]]),
        "teacher_logprobs": torch.tensor([[-0.5, -1.0, NAN]]),  # NaN off the mask is fine
        "has_teacher": torch.tensor([True]),
    }
    adv, metrics = OPDAdvantage()(batch)
    # [-0.5 - -1.0, -1.0 - -0.5, masked] = [0.5, -0.5, 0]
    assert adv.tolist() == [[0.5, -0.5, 0.0]]
    assert metrics["advantage_mean"].item() == pytest.approx(0.0)
    assert metrics["advantage_max"].item() == pytest.approx(0.5)


def test_sample_without_teacher_rejected() -> None:
    batch = {
        "mask": torch.ones(2, 2),
        "behaviour_logprobs": torch.zeros(2, 2),
        "teacher_logprobs": torch.tensor([[-1.0, -1.0], [NAN, NAN]]),
        "has_teacher": torch.tensor([True, False]),
    }
    with pytest.raises(ValueError, match="no teacher"):
        OPDAdvantage()(batch)
    del batch["has_teacher"]  # without the flag the NaN row itself is caught
    with pytest.raises(ValueError, match="NaN"):
        OPDAdvantage()(batch)
