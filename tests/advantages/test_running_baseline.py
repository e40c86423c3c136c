"""Issue 42, every sample teaches: a batch of four equal approvals used to have advantage 0 everywhere (consumed
without a gradient); with the running baseline (the default of method=rl and method=combine) it is centred on the
agent's running mean reward instead. Equal corrections keep 0 (pushing every token down flattens the language)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from metaclaw.advantages import CombineAdvantage, RLAdvantage
from metaclaw.config import CONFIG_DIR, register_resolvers


def batch(rewards: list[float], adapter: str = "default") -> dict:
    n = len(rewards)
    nan = torch.full((n, 3), float("nan"))
    return {"mask": torch.ones(n, 3), "reward": torch.tensor(rewards), "adapter": adapter,
            "behaviour_logprobs": torch.full((n, 3), -1.0), "teacher_logprobs": nan}  # fmt: skip


@pytest.mark.parametrize("cls", [RLAdvantage, CombineAdvantage])
def test_four_equal_approvals_still_teach(cls):
    adv = cls(normalize="mean", baseline_momentum=0.5)
    first, _ = adv(batch([1.0, -1.0, -1.0, 1.0]))  # running mean 0
    assert torch.allclose(first[:, 0], torch.tensor([1.0, -1.0, -1.0, 1.0]))  # a mixed batch: unchanged
    equal, _ = adv(batch([1.0] * 4))
    assert torch.allclose(equal, torch.ones(4, 3))  # r - 0, not 0
    assert adv.baseline.means["default"] == pytest.approx(0.5)
    other, _ = adv(batch([1.0] * 4, adapter="agent-b"))  # per agent: b has no history yet
    assert torch.count_nonzero(other) == 0
    corrected, _ = adv(batch([-1.0] * 4))  # equal corrections: still nothing pushed down
    assert torch.count_nonzero(corrected) == 0


def test_without_the_baseline_equal_rewards_train_nothing_and_it_is_the_default():
    zero, _ = RLAdvantage(normalize="mean", baseline_momentum=None)(batch([1.0] * 4))
    assert torch.count_nonzero(zero) == 0
    for method in ("rl", "combine"):
        register_resolvers()
        cfg = OmegaConf.load(CONFIG_DIR / "method" / f"{method}.yaml")
        assert cfg.advantage.baseline_momentum == 0.9  # the code's default (`${metaclaw_default:}`)
