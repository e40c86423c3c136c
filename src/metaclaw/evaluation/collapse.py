"""Collapse onto a stock phrase, measured over a set of held-out replies (CLaaS-style, issue 42).

A verifier that checks only the preference can be won by one phrase ("Sam." for a first-sentence rule, "I'm Kuro!"
for a name): the compliance rises while the replies stop answering. Beside compliance, every evaluation reports:

- `top_opening_share`: the share of replies whose opening (first sentence, its first five words, lower-cased) is
  the most common one, and that opening (`top_opening`);
- `opening_entropy`: the Shannon entropy of the openings (bits; log2 of the replies when all differ, 0 when one
  opening is every reply);
- `self_rouge_l`: the mean word-level ROUGE-L F1 between replies to the same prompt (CLaaS's self-ROUGE-L: near 1
  when sampling no longer changes the reply; kfallah/CLaaS `claas/eval/metrics/collapse.py` alerts above 0.85).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

_WORD = re.compile(r"[\w'’]+")
_SENTENCE_END = re.compile(r"[.!?。！？]\s|\n")


@dataclass
class CollapseStats:
    top_opening: str
    top_opening_share: float
    opening_entropy: float
    self_rouge_l: float | None  # None: no prompt had two replies


def opening(reply: str, words: int = 5) -> str:
    """The reply's first sentence, cut to its first `words` words, lower-cased ("" for no words)."""
    first = _SENTENCE_END.split(reply.strip(), maxsplit=1)[0]
    return " ".join(w.lower() for w in _WORD.findall(first)[:words])


def rouge_l(a: str, b: str) -> float:
    """Word-level ROUGE-L F1 (longest common subsequence of the words); 0 when either has no words."""
    x, y = a.split(), b.split()
    if not x or not y:
        return 0.0
    row = [0] * (len(y) + 1)
    for wx in x:
        prev = 0
        for j, wy in enumerate(y, 1):
            prev, row[j] = row[j], prev + 1 if wx == wy else max(row[j], row[j - 1])
    lcs = row[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(y), lcs / len(x)
    return 2 * precision * recall / (precision + recall)


def collapse_stats(replies_by_prompt: Sequence[Sequence[str]]) -> CollapseStats:
    """The collapse figures of the replies, grouped by the prompt they answer (at least one reply)."""
    openings = Counter(opening(r) for group in replies_by_prompt for r in group)
    n = sum(openings.values())
    if n == 0:
        raise ValueError("collapse_stats needs at least one reply")
    top, count = openings.most_common(1)[0]
    entropy = -sum(c / n * math.log2(c / n) for c in openings.values())
    pairs = [rouge_l(a, b) for group in replies_by_prompt for a, b in combinations(group, 2)]
    return CollapseStats(top, count / n, entropy + 0.0, sum(pairs) / len(pairs) if pairs else None)
