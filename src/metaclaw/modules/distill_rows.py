"""Distilled rows of a training batch: their own objective beside the policy loss (docs/learning.md).

A distilled row (`batch["distill"]`, `meta.distilled`: `scoring.distill`) holds a reply the teacher sampled with a
person's stated preference in context, set after the prompt WITHOUT it. Its stored behaviour logprobs are the
hinted distribution's, not the plain prompt's, so it never enters the policy loss (no importance ratio, no
advantage, no KL estimate, which all assume the tokens were sampled from the policy on this prompt). It gets the
cross-entropy term instead: ℓ = −log π(a_t | prompt without the preference), i.e. maximum likelihood on the
teacher's samples (forward KL from the hinted teacher). A row that names the prompt its teacher read
(`teacher_prompt_ids`) is trained toward the teacher's top-k tokens at every position instead (`self_distilled`,
`distill.top_k`): the corrected reply itself is such a row (`kind: own`), and is never trained on its own tokens.
Every other row trains exactly as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from metaclaw.advantages.base import AdvantageEstimator
from metaclaw.losses.base import PolicyLoss

if TYPE_CHECKING:
    from metaclaw.modules.policy import LoraPolicy

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class DistillTerm:
    """How distilled rows train (`distill.*`): `loss` (cross-entropy), its `weight` beside the policy loss, and
    `top_k`: rows that carry the prompt the teacher read (`teacher_prompt_ids`) are trained toward the teacher's
    `top_k` most likely tokens at every reply position (0: the sampled tokens only, for every row)."""

    loss: PolicyLoss
    weight: float = 1.0
    top_k: int = 0


def teacher_rows(batch: dict[str, Tensor], rows: Tensor | None, top_k: int) -> Tensor | None:
    """`[B]` bool of the distilled rows trained toward the teacher's top-k (they name the teacher's prompt), or
    None when there are none or `top_k` is 0."""
    if rows is None or top_k <= 0 or "has_teacher_prompt" not in batch:
        return None
    on = rows & batch["has_teacher_prompt"].bool()
    return on if bool(on.any()) else None


def without_untaught_own(batch: dict[str, Tensor], distill_mask: Tensor, taught: Tensor | None) -> Tensor:
    """`distill_mask` without the corrected replies (`distill_own`) that get no teacher here (`distill.top_k` 0, or
    no teacher prompt): trained on their own tokens they would be reinforced, against the person's correction."""
    own = batch.get("distill_own")
    if own is None or not bool(own.any()):
        return distill_mask
    untaught = own.bool() if taught is None else own.bool() & ~taught
    if not bool(untaught.any()):
        return distill_mask
    log.warning(
        "%d corrected replies have no teacher tokens in this step (distill.top_k 0, or a rank without teacher "
        "rows): left out of it",
        int(untaught.sum()),
    )
    return distill_mask * (~untaught).to(distill_mask.dtype)[:, None]


def self_distilled(
    policy: LoraPolicy, batch: dict[str, Tensor], on: Tensor, k: int
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Self-distillation from the person's words (SDPO's and CLaaS's per-token teacher), over one forward of the
    policy: `(logprobs, soft, metrics)`.

    The teacher is the base model (adapter disabled, no gradient) reading the reply after the conversation WITH the
    stated preference (`teacher_input_ids`). At each reply position it gives its `k` most likely tokens and their
    probabilities q under the row's sampling distribution; the rest of its mass is one more outcome, the tail. The
    student is the policy reading the same reply after the prompt WITHOUT the preference.

    `logprobs` `[B, T]` are the policy's logprobs of the sampled tokens (every row, as `OnlineRLModule._logprobs`).
    `soft` `[B, T]` is the soft-target log-likelihood at the reply positions of the rows `on` (`tailed`): its
    negative, token-averaged, is the cross-entropy term, whose gradient is that of the forward KL(q ‖ π) over the
    teacher's top-k and the tail. Both distributions are the row's own sampling distribution (temperature, top-p,
    top-k), the one behaviour and training logprobs are over. `distill_topk_kl` is that KL: 0 when the student is
    the teacher."""
    temperature, top_p, top_k = batch["temperature"], batch["top_p"], batch["top_k"]
    t_where = batch["teacher_mask"][on].bool()
    with policy.reference():
        ids, q_logs = policy.top_logprobs(batch["teacher_input_ids"][on], batch["teacher_attention_mask"][on],
                                          t_where, k, temperature[on], top_p[on], top_k[on])  # fmt: skip
    where = batch["mask"].bool() & on[:, None]
    if int(where.sum()) != ids.shape[0]:
        raise ValueError(f"the teacher scored {ids.shape[0]} reply tokens, the rows hold {int(where.sum())}")
    targets = batch["target_ids"].unsqueeze(-1).repeat(1, 1, ids.shape[1] + 1)
    targets[where] = torch.cat([batch["target_ids"][where].unsqueeze(-1), ids], dim=-1)
    ones = torch.ones_like(temperature)
    both = policy.logprobs(batch["input_ids"], targets, batch["attention_mask"], temperature,
                           batch.get("top_p", ones), batch.get("top_k", -ones.long()), mask=batch["mask"])  # fmt: skip
    student = both[where][:, 1:]  # [N, k]
    soft, kl = tailed(q_logs, student)
    out = torch.zeros_like(batch["mask"], dtype=soft.dtype)
    out[where] = soft
    metrics = {"distill_topk_kl": kl.mean().detach(), "distill_teacher_rows": on.sum().float()}
    return both[..., 0], out, metrics


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, stable at both ends (x is clamped just below 0: a tail of mass 0)."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def tailed(teacher: Tensor, student: Tensor) -> tuple[Tensor, Tensor]:
    """`(soft, kl)`, each `[N]`, from `[N, k]` logprobs of the teacher's top-k tokens under the teacher and the
    student: the k tokens plus one outcome for all the others (each side's remaining mass), so the soft
    log-likelihood Σ q log p is maximal exactly where the student gives those k tokens and the tail the teacher's
    probabilities, and `kl` = KL(q ‖ p) over those k + 1 outcomes (0 when they agree). A -inf teacher entry (a
    position that kept fewer than k tokens) counts as probability 0."""
    q = teacher.exp()
    known = q > 0
    q_tail_log = _log1mexp(torch.logsumexp(teacher, dim=-1))
    p_tail_log = _log1mexp(torch.logsumexp(student.masked_fill(~known, float("-inf")), dim=-1))
    q_tail = q_tail_log.exp()
    soft = (q * student.masked_fill(~known, 0.0)).sum(-1) + q_tail * p_tail_log
    kl = (q * (teacher - student).masked_fill(~known, 0.0)).sum(-1) + q_tail * (q_tail_log - p_tail_log)
    return soft, kl
