import pytest
import torch

from metaclaw.advantages import CombineAdvantage

NAN = float("nan")


def _batch() -> dict[str, torch.Tensor]:
    # row 0: teacher + reward; row 1: teacher only; row 2: reward only (its second token is masked)
    return {
        "mask": torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
        "behaviour_logprobs": torch.tensor([[-1.0, -1.0], [-1.0, -1.5], [-1.0, -1.0]]),
        "teacher_logprobs": torch.tensor([[-0.5, -1.0], [-2.0, -1.0], [NAN, NAN]]),
        "reward": torch.tensor([1.0, NAN, -1.0]),
        "has_teacher": torch.tensor([True, True, False]),
        "has_reward": torch.tensor([True, False, True]),
    }


def test_three_way_dispatch() -> None:
    adv, metrics = CombineAdvantage(w_opd=2.0, w_rl=0.5)(_batch())
    expected = [
        [1.5, 0.5],  # 2 * [-0.5 - -1.0, -1.0 - -1.0] + 0.5 * 1 = [1.0, 0.0] + 0.5
        [-2.0, 1.0],  # 2 * [-2.0 - -1.0, -1.0 - -1.5]
        [-0.5, 0.0],  # 0.5 * -1, masked second token
    ]
    assert torch.allclose(adv, torch.tensor(expected))
    assert {k: metrics[k].item() for k in ("n_opd_rl", "n_opd_only", "n_rl_only")} == {
        "n_opd_rl": 1,
        "n_opd_only": 1,
        "n_rl_only": 1,
    }
    # masked values [1.5, 0.5, -2.0, 1.0, -0.5]: mean 0.5 / 5 = 0.1
    assert metrics["advantage_mean"].item() == pytest.approx(0.1)
    assert metrics["advantage_min"].item() == pytest.approx(-2.0)
    assert metrics["advantage_max"].item() == pytest.approx(1.5)


def test_flags_derived_from_nan_when_absent() -> None:
    batch = _batch()
    del batch["has_teacher"], batch["has_reward"]
    adv, _ = CombineAdvantage(w_opd=2.0, w_rl=0.5)(batch)
    assert torch.allclose(adv, torch.tensor([[1.5, 0.5], [-2.0, 1.0], [-0.5, 0.0]]))


def test_normalize_uses_rewarded_samples_only() -> None:
    batch = _batch()
    batch["reward"] = torch.tensor([1.0, NAN, 0.0])  # rewarded rows 0 and 2: mean 0.5 -> [0.5, -0.5]
    adv, _ = CombineAdvantage(w_opd=2.0, w_rl=0.5, normalize="mean")(batch)
    # row 0: [1.0, 0.0] + 0.5 * 0.5; row 2: 0.5 * -0.5
    assert torch.allclose(adv, torch.tensor([[1.25, 0.25], [-2.0, 1.0], [-0.25, 0.0]]))


def test_sample_with_neither_rejected() -> None:
    batch = _batch()
    batch["has_reward"] = torch.tensor([True, False, False])
    with pytest.raises(ValueError, match="neither"):
        CombineAdvantage()(batch)


def test_combine_normalises_rewards_over_the_global_batch() -> None:
    from metaclaw.advantages import CombineAdvantage

    mask = torch.ones(1, 2)
    batch = {
        "mask": mask,
        "behaviour_logprobs": torch.zeros(1, 2),
        "teacher_logprobs": torch.full((1, 2), float("nan")),
        "reward": torch.tensor([1.0]),
        "group_reward": torch.tensor([1.0, float("nan"), -1.0]),  # another rank's teacher-only sample: NaN
    }
    adv, _ = CombineAdvantage(normalize="mean_std", eps=0.0)(batch)
    assert torch.allclose(adv, torch.ones(1, 2))
