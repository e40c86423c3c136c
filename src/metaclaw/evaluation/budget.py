"""`EvalBudget`: how much of the run's time adapter evaluations during training may take (`eval.max_share`),
and when the base model is measured (`eval.baseline`).

An adapter evaluation during training is skipped when it would bring the evaluator's busy time above `max_share`
of the time since it started (the next one is taken to cost what the last one did); the base model and the final
adapter are always measured. With `baseline="auto"` the base model is measured first when its replies are cached
(free), else after training (deferred), and no ungated adapter is measured during training meanwhile (its quality
figures would need the base model's first).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from metaclaw.evaluation.evaluator import EvalResult
from metaclaw.evaluation.gate import HotLoad, Track


class EvalBudget:
    """The evaluator's share of the run's time and the base model's place in it.

    Args:
        max_share: the most of the run's time evaluations during training may take (None: no limit).
        baseline: `first` (the base model before any adapter) or `auto` (first when cached, else at the end).
    """

    def __init__(self, max_share: float | None = None, baseline: str = "first") -> None:
        if baseline not in ("first", "auto"):
            raise ValueError(f"eval.baseline must be first or auto, got {baseline!r}")
        if max_share is not None and not 0 < max_share <= 1:
            raise ValueError(f"eval.max_share must be in (0, 1] or null, got {max_share}")
        self.max_share, self.baseline = max_share, baseline
        self.started_at: float | None = None
        self.busy_s, self.last_cost = 0.0, 0.0  # seconds spent evaluating (cache hits cost none)
        self.training_over = False
        self.deferred: list[str] = []  # agents whose base model is measured after training

    def start(self) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic()

    def defer_baseline(self, track: Track, base_model: str, gated: bool) -> bool:
        """Whether `track`'s base model waits for the end of training (`auto`, not gated, not cached yet)."""
        if self.baseline != "auto" or gated:
            return False
        cached: Any = getattr(track.evaluator, "has_cached", None)
        if cached is None or cached(base_model):
            return False
        self.deferred.append(track.agent)
        return True

    def take_deferred(self) -> list[str]:
        """The agents whose base model is measured now (the end of training)."""
        agents, self.deferred = self.deferred, []
        return agents

    def charge(self, result: EvalResult) -> None:
        """Count an evaluation's time (a cached one costs nothing)."""
        if not result.cached:
            self.busy_s += result.seconds
            self.last_cost = result.seconds

    def over(self, track: Track, step: int, path: Path | None, hot_load: HotLoad | None) -> bool:
        """A mid-training adapter evaluation (not the base, not the final; a gated candidate too) that would exceed
        the budget; with the base model deferred, every ungated one (its quality figures would measure the base
        model now). The judge fallback's gate is not budgeted here (it measures served turns, not replies)."""
        if path is None or step < 0 or self.training_over or (hot_load is not None and track.by_version):
            return False
        if track.agent in self.deferred and hot_load is None:
            return True
        if self.max_share is None:
            return False
        elapsed = time.monotonic() - (self.started_at or time.monotonic())
        return self.busy_s + self.last_cost > self.max_share * (elapsed + self.last_cost)

    def why(self) -> str:
        """The budget's state in words (a skip's reason)."""
        return (f"evaluations took {self.busy_s:.0f}s of {time.monotonic() - (self.started_at or 0.0):.0f}s "
                f"(eval.max_share {self.max_share})")  # fmt: skip
