"""Explicit feedback (`POST /v1/feedback`): how a user's score and correction enter a turn's training signal.

The proxy stores `{score, text, at}` as the sample's `meta.feedback`; the scoring worker then settles that turn
with it: the reward is the feedback score (`mode: override`) or a weighted mean of judge and feedback
(`mode: weight`), and the text is the turn's OPD hint. A turn with feedback never takes part in at-least-one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODES = ("override", "weight")


@dataclass(frozen=True)
class FeedbackRule:
    """How feedback combines with the judge.

    Args:
        mode: `override` (the feedback score is the reward; the judge is not asked) or `weight`.
        weight: in `weight` mode, reward = (1 - weight) * judge + weight * feedback.
    """

    mode: str = "override"
    weight: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"feedback.mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"feedback.weight must be in [0, 1], got {self.weight!r}")

    @classmethod
    def of(cls, cfg: FeedbackRule | Mapping[str, Any] | None) -> FeedbackRule:
        if isinstance(cfg, FeedbackRule):
            return cfg
        return cls(**dict(cfg or {}))

    @property
    def needs_judge(self) -> bool:
        return self.mode == "weight"

    def reward(self, judge: float | None, score: float) -> float:
        """The turn's reward given the judge's (None when not asked) and the feedback score."""
        if self.mode == "override" or judge is None:
            return float(score)
        return (1.0 - self.weight) * float(judge) + self.weight * float(score)


def feedback_of(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The sample's recorded feedback (`{score, text, at}`), if any well-formed one."""
    fb = meta.get("feedback")
    if not isinstance(fb, dict):
        return None
    score = fb.get("score")
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        return None
    return fb
