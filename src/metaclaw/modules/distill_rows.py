"""Distilled rows of a training batch: their own objective beside the policy loss (docs/learning.md).

A distilled row (`batch["distill"]`, `meta.distilled`: `scoring.distill`) holds a reply the teacher sampled with a
person's stated preference in context, set after the prompt WITHOUT it. Its stored behaviour logprobs are the
hinted distribution's, not the plain prompt's, so it never enters the policy loss (no importance ratio, no
advantage, no KL estimate, which all assume the tokens were sampled from the policy on this prompt). It gets the
cross-entropy term instead: ℓ = −log π(a_t | prompt without the preference), i.e. maximum likelihood on the
teacher's samples (forward KL from the hinted teacher). Every other row trains exactly as before.
"""

from __future__ import annotations

import torch
from torch import Tensor

from metaclaw.advantages.base import AdvantageEstimator
from metaclaw.losses.base import PolicyLoss

GROUP_KEYS = ("group_reward", "group_tokens", "group_sequences", "group_distill_tokens", "group_distill_sequences")


def distilled_rows(batch: dict[str, Tensor]) -> Tensor | None:
    """`[B]` bool of the distilled rows, or None when the batch has none (then nothing changes)."""
    rows = batch.get("distill")
    if rows is None or not bool(rows.any()):
        return None
    return rows.bool()


def split_mask(mask: Tensor, rows: Tensor | None) -> tuple[Tensor, Tensor]:
    """`(policy_mask, distill_mask)`: the response tokens of the policy rows and of the distilled rows."""
    if rows is None:
        return mask, torch.zeros_like(mask)
    on = rows.to(mask.dtype)[:, None]
    return mask * (1 - on), mask * on


def part_totals(batch: dict[str, Tensor], distilled: bool) -> dict[str, Tensor]:
    """The global batch's response tokens and sequences of one part (for `global_scale` under DDP)."""
    if "group_distill_tokens" not in batch:
        return batch
    tokens, seqs = batch["group_distill_tokens"], batch["group_distill_sequences"]
    if distilled:
        return {"group_tokens": tokens, "group_sequences": seqs}
    return {"group_tokens": batch["group_tokens"] - tokens, "group_sequences": batch["group_sequences"] - seqs}


def policy_advantages(
    estimator: AdvantageEstimator, batch: dict[str, Tensor], rows: Tensor | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The estimator's advantages `[B, T]` over the policy rows only (0 on distilled rows, which carry no reward
    or teacher signal and would be refused by it); the estimator is not called when every row is distilled."""
    if rows is None:
        return estimator(batch)
    keep = ~rows
    out = torch.zeros_like(batch["mask"])
    if not bool(keep.any()):
        return out, {}
    size = rows.shape[0]
    sub = {
        k: v[keep] if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == size and k not in GROUP_KEYS else v
        for k, v in batch.items()
    }
    advantages, metrics = estimator(sub)
    out[keep] = advantages.to(out.dtype)
    return out, metrics


def distill_term(
    loss_fn: PolicyLoss, logprobs: Tensor, batch: dict[str, Tensor], distill_mask: Tensor, rows: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The distilled rows' loss (`distill.loss`, cross-entropy: it reads only `logprobs` and the mask) and its
    metrics, namespaced `distill_*`."""
    out = loss_fn(logprobs, batch["behaviour_logprobs"], torch.zeros_like(logprobs), distill_mask)
    metrics = {f"distill_{k}": v for k, v in out.metrics.items()}
    return out.loss, {**metrics, "distill_rows": rows.sum().float()}


def with_distilled(advantages: Tensor, distill_mask: Tensor) -> Tensor:
    """`advantages` with 1 on distilled tokens: what the step's skip rule and `zero_advantage_frac` read (a batch
    of distilled rows only is never a zero-advantage batch)."""
    return torch.where(distill_mask > 0, torch.ones_like(advantages), advantages)
