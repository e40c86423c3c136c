"""`LoopProgressBar`: the online loop's progress as a user reads it, not as an epoch of a finite dataset.

    training  42%|████▏     | 252/600s [04:12<05:48, step=31, samples=124, held-out=34% [20-51] @v28, backlog=3]

The bar runs against the training budget: seconds of `trainer.max_time` when there is one, else steps of
`trainer.max_steps`, else it just counts steps. Beside it: optimizer steps, samples trained, the last held-out
compliance with its 95% interval and the adapter it measured (`LiveEvaluator`), the backlog (samples waiting to
be trained, `rollout/backlog` from `HealthMonitor`) and the step's loss.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


def budget_seconds(trainer: L.Trainer) -> float | None:
    """`trainer.max_time` in seconds (None: no time budget)."""
    for cb in trainer.callbacks:
        duration = getattr(cb, "_duration", None)  # Lightning's Timer callback holds max_time
        if type(cb).__name__ == "Timer" and duration:
            return float(duration)
    return None


class LoopProgressBar(TQDMProgressBar):
    """Steps against the time (or step) budget, samples trained, last held-out compliance, backlog."""

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.samples = 0
        self._t0: float | None = None
        self._budget_s: float | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self._budget_s = budget_seconds(trainer)
        self._t0 = self._t0 or time.monotonic()
        bar = self.train_progress_bar
        if self._budget_s:
            bar.total, bar.unit = int(self._budget_s), "s"
        else:
            bar.total, bar.unit = (trainer.max_steps if trainer.max_steps > 0 else None), "step"
        bar.set_description("training")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        mask = batch.get("mask") if isinstance(batch, dict) else None
        if mask is not None and not batch.get("epoch"):  # a PPO epoch's repeat trains no new sample
            self.samples += int(mask.shape[0])
        bar = self._train_progress_bar
        if bar is None or bar.disable:
            return
        if self._budget_s:
            bar.n = min(int(time.monotonic() - (self._t0 or time.monotonic())), int(self._budget_s))
        else:
            bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=True)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        out: dict[str, Any] = {"step": trainer.global_step, "samples": self.samples}
        heldout = last_heldout(trainer)
        if heldout:
            out["held-out"] = heldout
        metrics = trainer.progress_bar_metrics
        if "rollout/backlog" in metrics:
            out["backlog"] = int(metrics["rollout/backlog"])
        if "loss/total" in metrics:
            out["loss"] = f"{metrics['loss/total']:.3g}"
        for key in ("train/publish_failures", "rollout/capture_failures", "rollout/judge_failures"):
            if metrics.get(key):  # only when something went wrong
                out[key.split("/")[-1]] = int(metrics[key])
        return out


def last_heldout(trainer: L.Trainer) -> str | None:
    """`34% [20-51] @v28`: the default agent's latest evaluation, from the `LiveEvaluator` among the callbacks."""
    for cb in trainer.callbacks:
        results = getattr(cb, "results", None)
        if type(cb).__name__ != "LiveEvaluator" or not results:
            continue
        mine = [r for r in results if r.get("agent_id", "default") == "default"]
        if not mine:
            return None
        r = mine[-1]
        ci = "" if r.get("ci_low") is None else f" [{100 * r['ci_low']:.0f}-{100 * r['ci_high']:.0f}]"
        return f"{100 * r['compliance']:.0f}%{ci} @{'base' if r['step'] == 0 else 'v' + str(r['step'])}"
    return None
