"""Reply quality beside compliance: is the agent still writing language, or junk that happens to pass the rule?

- **Base NLL**: the base model's mean negative log-likelihood per token of a reply (nats/token), teacher-forced
  on the prompt the server rendered, through the same `/v1/completions` prompt-logprobs call OPD's teacher uses
  (`metaclaw.wire.client.teacher_logprobs`, raw logits at T = 1, adapter disabled). The base model's own
  replies at T = 1 score about its entropy; an adapter whose replies drift into text the base model finds
  implausible scores higher. A reply is **fluent** when its NLL is within `nll_margin` of the base model's mean
  on its own replies; a **good** reply complies and is fluent.
- **Cheap signals**: `distinct_2` (distinct word bigrams / all bigrams over the replies: the same reply to every
  prompt scores low), `distinct_replies` (unique replies / replies), `junk` (share of replies that are empty or
  repetitive: no letters, or fewer than half their words distinct).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from metaclaw.wire.client import Endpoint, teacher_logprobs

_WORD = re.compile(r"[\w']+")


def base_nll(
    endpoint: Endpoint,
    base_model: str,
    prompt_ids: Sequence[int],
    reply_ids: Sequence[int],
    timeout_s: float = 120.0,
    user: str | None = None,
) -> float | None:
    """Mean NLL per token (nats) of `reply_ids` after `prompt_ids` under the base model; None for an empty reply."""
    if not reply_ids:
        return None
    lps = teacher_logprobs(endpoint, base_model, prompt_ids, reply_ids, timeout_s, user=user)
    return -sum(lps) / len(lps)


def fluency(
    nlls: Sequence[float | None], compliant: Sequence[bool], reference: float | None, margin: float
) -> dict[str, float | None]:
    """`nll` (mean over the scored replies), and against the base model's `reference` mean: `nll_threshold`,
    `fluent` (NLL <= reference + margin; an unscored, i.e. empty, reply never is) and `good` (fluent and
    compliant) shares. Without a reference only `nll`."""
    scored = [x for x in nlls if x is not None]
    out: dict[str, float | None] = {"nll": sum(scored) / len(scored) if scored else None}
    if reference is None or not nlls:
        return out
    threshold = reference + margin
    fluent = [x is not None and x <= threshold for x in nlls]
    out.update(
        nll_threshold=threshold,
        fluent=sum(fluent) / len(nlls),
        good=sum(f and c for f, c in zip(fluent, compliant, strict=True)) / len(nlls),
    )
    return out


def is_junk(reply: str) -> bool:
    """Empty (no letters) or repetitive (4+ words, fewer than half of them distinct)."""
    words = [w.lower() for w in _WORD.findall(reply)]
    if not any(c.isalpha() for c in reply):
        return True
    return len(words) >= 4 and len(set(words)) < len(words) / 2


@dataclass
class TextStats:
    """Cheap diversity signals over a set of replies."""

    distinct_2: float
    distinct_replies: float
    junk: float


def text_stats(replies: Sequence[str]) -> TextStats:
    """Distinct word bigrams, unique replies and the junk share over `replies` (non-empty list)."""
    bigrams: list[tuple[str, str]] = []
    for reply in replies:
        words = [w.lower() for w in _WORD.findall(reply)]
        bigrams.extend(zip(words, words[1:], strict=False))
    n = max(len(replies), 1)
    return TextStats(
        distinct_2=len(set(bigrams)) / len(bigrams) if bigrams else 0.0,
        distinct_replies=len({" ".join(r.split()).lower() for r in replies}) / n,
        junk=sum(is_junk(r) for r in replies) / n,
    )
