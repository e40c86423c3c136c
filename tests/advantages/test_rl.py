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


@pytest.mark.parametrize("normalize", ["mean", "mean_std"])
def test_a_rank_slice_is_normalised_over_the_global_batch(normalize: str) -> None:
    """DDP: each rank holds part of the step's batch; its advantages equal the single-process ones."""
    whole, _ = RLAdvantage(normalize=normalize, eps=0.0)({"mask": MASK, "reward": REWARD})
    for rows in ([0], [1, 2]):  # e.g. rank 0 and rank 1 of an uneven split
        part = {"mask": MASK[rows], "reward": REWARD[rows], "group_reward": torch.tensor([2.0, 0.0, 1.0, NAN])}
        adv, _ = RLAdvantage(normalize=normalize, eps=0.0)(part)
        assert torch.allclose(adv, whole[rows], atol=1e-6)


def test_one_sample_per_rank_with_mean_std_is_not_all_zero() -> None:
    mask = torch.ones(1, 2)
    adv, _ = RLAdvantage(normalize="mean_std", eps=0.0)(
        {"mask": mask, "reward": torch.tensor([1.0]), "group_reward": torch.tensor([1.0, -1.0])}
    )
    assert torch.allclose(adv, torch.ones(1, 2))


def test_a_centred_batch_of_one_says_it_learns_nothing_from_the_reward(caplog, monkeypatch) -> None:
    import metaclaw.advantages.base as base

    monkeypatch.setattr(base, "_warned_batch_of_one", False)
    one = {"mask": torch.ones(1, 2), "reward": torch.tensor([1.0])}
    with caplog.at_level("WARNING", logger="metaclaw.advantages.base"):
        adv, _ = RLAdvantage(normalize="mean")(one)
        RLAdvantage(normalize="mean")(one)
    assert torch.count_nonzero(adv) == 0
    warnings = [r for r in caplog.records if "batch of one" in r.getMessage()]
    assert len(warnings) == 1 and "data.min_batch_size" in warnings[0].getMessage()  # loud, and once
    caplog.clear()
    RLAdvantage(normalize="mean")({"mask": torch.ones(2, 2), "reward": torch.tensor([1.0, -1.0])})
    RLAdvantage(normalize="none")(one)
    assert not [r for r in caplog.records if "batch of one" in r.getMessage()]
