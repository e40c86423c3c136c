"""On-policy distillation advantage: the teacher's per-token log-prob gap over the student."""

from __future__ import annotations

import torch
from torch import Tensor

from metaclaw.advantages.base import advantage_stats, require, teacher_advantage


class OPDAdvantage:
    """A_{b,t} = log π_teacher(a_t) − log π_behaviour(a_t) on masked tokens, 0 elsewhere; shapes ``[B, T]``.

    The student log-probs are the sampler's (``behaviour_logprobs``), as in OpenClaw-RL's OPD. Raises
    ValueError if a sample has no teacher signal (``has_teacher`` false or NaN teacher log-probs on a response
    token): the scorer drops those upstream.
    """

    def __call__(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        require(batch, "mask", "behaviour_logprobs", "teacher_logprobs")
        mask = batch["mask"]
        has_teacher = batch.get("has_teacher", torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device))
        if not bool(has_teacher.all()):
            raise ValueError(f"samples {(~has_teacher).nonzero().flatten().tolist()} have no teacher signal")
        advantages = teacher_advantage(batch, has_teacher)
        return advantages, advantage_stats(advantages, mask)
