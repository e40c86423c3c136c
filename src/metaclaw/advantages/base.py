"""Shared pieces of the advantage estimators: the plug-point Protocol, reward normalisation, statistics."""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import Tensor

NORMALIZE_MODES = ("none", "mean", "mean_std")
log = logging.getLogger(__name__)
_warned_batch_of_one = False


class AdvantageEstimator(Protocol):
    """Turns a scored batch into per-token advantages.

    ``batch`` holds ``mask [B, T]`` and, as the method needs, ``behaviour_logprobs [B, T]``, ``reward [B]``
    (NaN when unscored), ``teacher_logprobs [B, T]`` (all-NaN rows without teacher signal),
    ``has_reward [B]`` and ``has_teacher [B]``. Returns advantages ``[B, T]`` (0 where ``mask == 0``)
    and detached scalar metrics.
    """

    def __call__(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]: ...


def check_normalize(mode: str) -> str:
    """Return ``mode`` if it is a known normalisation, else raise ValueError listing the valid ones."""
    if mode not in NORMALIZE_MODES:
        raise ValueError(f"unknown normalize {mode!r}; valid modes: {', '.join(NORMALIZE_MODES)}")
    return mode


def normalize_rewards(reward: Tensor, mode: str, eps: float, group: Tensor | None = None) -> Tensor:
    """Normalise rewards ``[N]`` across the batch (GRPO-like, one group = the batch).

    ``"none"``: unchanged; ``"mean"``: r − mean(r); ``"mean_std"``: (r − mean(r)) / (std(r) + eps), with the
    population std so a batch of one is defined (gives 0). ``group``: the rewards the statistics are taken over
    when ``reward`` is one DDP rank's slice of the step's batch (its NaNs, unscored samples, are left out).
    """
    check_normalize(mode)
    if mode == "none" or reward.numel() == 0:
        return reward
    stats = reward if group is None else group[~torch.isnan(group)].to(reward)
    if stats.numel() == 1:
        _warn_batch_of_one(mode)
    centred = reward - stats.mean()
    if mode == "mean":
        return centred
    return centred / (stats.std(correction=0) + eps)


class RunningBaseline:
    """A per-agent running mean of batch rewards: the baseline of a batch whose rewards are all equal.

    Centred over its own mean, such a batch has advantage 0 everywhere and trains nothing, yet its samples are
    consumed. When every reward of the batch is the same approval (> 0) and above the agent's running mean of
    earlier batches, the advantage is r − that mean instead (REINFORCE with a running baseline): approvals that
    came four at a time still teach. A batch of equal corrections or no-reactions keeps advantage 0: pushing
    every sampled token down flattens the language (docs/learning.md, "Every sample teaches").

    Args:
        momentum: weight of the old mean in the exponential moving average (per agent: the batch's `adapter`).
        max_agents: agents remembered (bounded; the least recently seen is forgotten).
    """

    def __init__(self, momentum: float = 0.9, max_agents: int = 1024) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"method.advantage.baseline_momentum must be in [0, 1), got {momentum}")
        self.momentum, self.max_agents = momentum, max_agents
        self.means: dict[str, float] = {}

    def __call__(self, reward: Tensor, scaled: Tensor, group: Tensor | None, agent: str) -> Tensor:
        """`scaled` (the batch-centred advantages of `reward` [N]), or r − baseline for an all-equal approved
        batch above the agent's running mean; the mean is updated with this batch (`group`: the step's rewards)."""
        stats = reward if group is None else group[~torch.isnan(group)].to(reward)
        if stats.numel() == 0:
            return scaled
        before = self.means.pop(agent, None)
        mean = float(stats.mean())
        self.means[agent] = mean if before is None else self.momentum * before + (1 - self.momentum) * mean
        if len(self.means) > self.max_agents:
            self.means.pop(next(iter(self.means)))
        equal = float(stats.max() - stats.min()) == 0.0
        if before is None or not equal or mean <= 0 or mean <= before:
            return scaled
        return reward - before


def _warn_batch_of_one(mode: str) -> None:
    """Never silent: a centred reward over one sample is 0, so such a step learns nothing from the reward."""
    global _warned_batch_of_one
    if not _warned_batch_of_one:
        _warned_batch_of_one = True
        log.warning(
            "normalize=%s over a batch of one scored sample: its reward advantage is 0 and the step learns nothing "
            "from the reward (set data.min_batch_size >= 2, as rollout=simulated_user does). Warned once.",
            mode,
        )


def require(batch: dict[str, Tensor], *keys: str) -> None:
    """Raise KeyError naming the batch keys an estimator needs but did not get."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"batch is missing {missing}; it has {sorted(batch)}")


def teacher_advantage(batch: dict[str, Tensor], rows: Tensor) -> Tensor:
    """teacher − student log-probs ``[B, T]`` on masked tokens of ``rows``, 0 elsewhere.

    The student is the sampler (``behaviour_logprobs``), as in OpenClaw-RL's OPD. Raises ValueError if a
    selected row has NaN teacher log-probs on a masked token.
    """
    on = (batch["mask"] > 0) & rows[:, None]
    teacher = batch["teacher_logprobs"]
    bad = (on & torch.isnan(teacher)).any(dim=-1)
    if bool(bad.any()):
        raise ValueError(f"teacher_logprobs are NaN on response tokens of samples {bad.nonzero().flatten().tolist()}")
    diff = teacher - batch["behaviour_logprobs"]
    return torch.where(on, diff, torch.zeros_like(diff))


@torch.no_grad()
def advantage_stats(advantages: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Mean/std/min/max of the advantages over masked tokens (zeros when the mask is empty), logged by
    `OnlineRLModule` as `train/advantage_{mean,std,min,max}`."""
    values = advantages[mask > 0]
    if values.numel() == 0:
        zero = advantages.new_zeros(())
        return {"advantage_mean": zero, "advantage_std": zero, "advantage_min": zero, "advantage_max": zero}
    return {
        "advantage_mean": values.mean(),
        "advantage_std": values.std(correction=0),
        "advantage_min": values.min(),
        "advantage_max": values.max(),
    }
