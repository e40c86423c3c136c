"""RL advantage: the judge's scalar reward broadcast over the response tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from metaclaw.advantages.base import (
    RunningBaseline,
    advantage_stats,
    check_normalize,
    normalize_rewards,
    require,
)


class RLAdvantage:
    """A_{b,t} = norm(r)_b on masked tokens, 0 elsewhere; ``reward [B]`` → advantages ``[B, T]``.

    Args:
        normalize: ``"none"``, ``"mean"`` (r − mean, the default: seed 002's GRPO advantage) or ``"mean_std"``
            ((r − mean)/(std + eps)), across the step's global batch (``group_reward`` when the batch is one DDP
            rank's slice).
        eps: Added to the std in ``"mean_std"``.
        baseline_momentum: with normalisation, a batch of equal approvals is centred on the agent's running mean
            reward instead (`RunningBaseline`, momentum 0.9 by default); None: off (such a batch trains nothing).

    Raises ValueError if a sample has no reward (NaN or ``has_reward`` false): the scorer must drop it.
    """

    def __init__(self, normalize: str = "mean", eps: float = 1e-6, baseline_momentum: float | None = 0.9) -> None:
        self.normalize = check_normalize(normalize)
        self.eps = eps
        on = baseline_momentum is not None and normalize != "none"
        self.baseline = RunningBaseline(baseline_momentum) if on and baseline_momentum is not None else None

    def __call__(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        require(batch, "mask", "reward")
        mask, reward = batch["mask"], batch["reward"]
        has_reward = batch.get("has_reward", ~torch.isnan(reward)) & ~torch.isnan(reward)
        if not bool(has_reward.all()):
            raise ValueError(f"samples {(~has_reward).nonzero().flatten().tolist()} have no reward")
        scaled = normalize_rewards(reward, self.normalize, self.eps, batch.get("group_reward"))
        if self.baseline is not None:
            scaled = self.baseline(reward, scaled, batch.get("group_reward"), str(batch.get("adapter", "default")))
        advantages = torch.where(mask > 0, scaled[:, None].expand_as(mask), torch.zeros_like(mask))
        metrics = {"reward_mean": reward.mean().detach(), **advantage_stats(advantages, mask)}
        return advantages, metrics
