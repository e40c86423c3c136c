"""Combined advantage: OPD and RL, dispatched per sample on which signals it has."""

from __future__ import annotations

import torch
from torch import Tensor

from metaclaw.advantages.base import (
    RunningBaseline,
    advantage_stats,
    check_normalize,
    normalize_rewards,
    require,
    teacher_advantage,
)


class CombineAdvantage:
    """Three-way per-sample dispatch (OpenClaw-RL ``--method combine``); shapes ``[B, T]``:

    - teacher and reward: A_t = w_opd·(log π_teacher − log π_behaviour)_t + w_rl·r
    - teacher only:       A_t = w_opd·(log π_teacher − log π_behaviour)_t
    - reward only:        A_t = w_rl·r

    Masked-out tokens get 0. A sample with neither signal raises ValueError (the scorer drops those).

    Args:
        w_opd: Weight of the teacher (distillation) term.
        w_rl: Weight of the reward term.
        normalize: ``"none"``, ``"mean"`` or ``"mean_std"`` applied to the rewards of the samples that have one.
        eps: Added to the std in ``"mean_std"``.
        baseline_momentum: see `RLAdvantage` (a batch of equal approvals, centred on a running mean).

    Metrics: ``n_opd_rl``, ``n_opd_only``, ``n_rl_only`` and ``advantage_mean/std/min/max``.
    """

    def __init__(
        self,
        w_opd: float = 1.0,
        w_rl: float = 1.0,
        normalize: str = "mean",
        eps: float = 1e-6,
        baseline_momentum: float | None = 0.9,
    ) -> None:
        self.w_opd = w_opd
        self.w_rl = w_rl
        self.normalize = check_normalize(normalize)
        self.eps = eps
        on = baseline_momentum is not None and normalize != "none"
        self.baseline = RunningBaseline(baseline_momentum) if on and baseline_momentum is not None else None

    def __call__(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        require(batch, "mask", "behaviour_logprobs", "reward", "teacher_logprobs")
        mask, reward = batch["mask"], batch["reward"]
        has_reward = batch.get("has_reward", ~torch.isnan(reward)) & ~torch.isnan(reward)
        teacher_rows = ~torch.isnan(batch["teacher_logprobs"]).all(dim=-1)
        has_teacher = batch.get("has_teacher", teacher_rows)
        neither = ~has_reward & ~has_teacher
        if bool(neither.any()):
            raise ValueError(f"samples {neither.nonzero().flatten().tolist()} have neither reward nor teacher signal")

        scaled = torch.zeros_like(reward)
        scaled[has_reward] = normalize_rewards(reward[has_reward], self.normalize, self.eps, batch.get("group_reward"))
        if self.baseline is not None:
            agent = str(batch.get("adapter", "default"))
            scaled[has_reward] = self.baseline(reward[has_reward], scaled[has_reward], batch.get("group_reward"), agent)
        rl_term = torch.where((mask > 0) & has_reward[:, None], scaled[:, None].expand_as(mask), 0.0)
        advantages = self.w_opd * teacher_advantage(batch, has_teacher) + self.w_rl * rl_term

        counts = {
            "n_opd_rl": (has_teacher & has_reward).sum(),
            "n_opd_only": (has_teacher & ~has_reward).sum(),
            "n_rl_only": (~has_teacher & has_reward).sum(),
        }
        metrics = {k: v.to(advantages.dtype) for k, v in counts.items()}
        return advantages, {**metrics, **advantage_stats(advantages, mask)}
