"""`HealthMonitor`: what the loop captured, failed on and dropped, in the logger and the progress bar.

Each optimizer step, rank 0 logs (cumulative counts since the run started, or the store's totals):

| metric | from |
|---|---|
| `rollout/captured`, `rollout/capture_failures` | the proxy: turns stored / turns it could not store |
| `rollout/skills_only_turns` | the proxy: main turns of `skills_only` agents, answered and never captured |
| `rollout/capture_paused` | turns not stored because the backlog bound paused capture (`pause_capture`) |
| `rollout/judge_failures` | turns whose scoring failed `max_attempts` times (dropped, `judge_failed`) |
| `rollout/pending`, `rollout/ready`, `rollout/backlog` | the store: waiting for a score / to be trained |
| `rollout/dropped`, `rollout/dropped_<reason>` | the store: dropped samples, by `meta.dropped` reason |
| `rollout/replies_per_min`, `rollout/reply_tokens_per_s` | the store: main turns captured (serving's pace) |
| `train/samples_per_min`, `train/sample_age_s`, `train/version_lag` | the store: samples trained (training's \
pace), and the median age (capture → training) and adapter-version lag of those, over the last `rate_window_s` |
| `skills/evolutions`, `skills/accepted`, `skills/unusable`, `skills/skipped` | the skill evolver (skills on): \
calls, skills written, calls that gave nothing usable, calls skipped while it backs off |

The same counters are Prometheus series at scrape time (`/metrics`, `metaclaw.ops.metrics.LoopCollector`), and
each step counts `metaclaw_train_steps`.

The training side (`train/skipped_*`, `train/zero_advantage_frac`, `train/publish_failures`) is logged by
`OnlineRLModule` and `AdapterPublisher`. Live sources are attached by `training.train` once the loop started.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L

from metaclaw.ops import metrics
from metaclaw.store import SampleStore, open_store

log = logging.getLogger(__name__)
PROGRESS_BAR = ("rollout/captured", "rollout/capture_failures", "rollout/judge_failures", "rollout/backlog")


def _floats(values: Any) -> dict[str, float]:
    return {k: float(v) for k, v in dict(values).items() if getattr(v, "numel", lambda: 1)() == 1}


def step_line(step: int, m: dict[str, float]) -> str:
    """The one INFO line of an optimizer step: what it trained on and how, and what waits (docs/operate.md)."""
    parts = [f"Step {step}:"]
    figures = (("loss", "loss/total", "{:.4f}"), ("reward", "rollout/reward_mean", "{:+.2f}"),
               ("lr", "train/lr", "{:.2g}"), ("grad norm", "train/grad_norm", "{:.3g}"),
               ("backlog", "rollout/backlog", "{:.0f}"), ("samples/min", "train/samples_per_min", "{:.1f}"),
               ("sample age", "train/sample_age_s", "{:.0f} s"))  # fmt: skip
    parts += [f"{label} {fmt.format(m[key])}" for label, key, fmt in figures if key in m]
    if "loss/ratio_mean" in m:  # behaviour vs the trainer's recomputation (a quantised engine's gap is counted here)
        ratio = f"ratio {m['loss/ratio_mean']:.3f}"
        if "loss/ratio_min" in m and "loss/ratio_max" in m:
            ratio += f" [{m['loss/ratio_min']:.3f}, {m['loss/ratio_max']:.3f}]"
        parts.append(ratio)
    for label, key in (("clipped", "loss/clip_frac"), ("truncated", "loss/ratio_truncated_frac")):
        if key in m:
            parts.append(f"{label} {m[key]:.1%}")
    return " ".join(parts[:1]) + " " + ", ".join(parts[1:])


class HealthMonitor(L.Callback):
    """Logs the loop's counters every `every_n_steps` optimizer steps (rank 0 only).

    Args:
        store_path: the sample store.
        every_n_steps: logging cadence (a store query per log).
        rate_window_s: the window of the pace figures (`SampleStore.rates`).
    """

    def __init__(self, store_path: str, every_n_steps: int = 1, rate_window_s: float = 300.0) -> None:
        if every_n_steps < 1:
            raise ValueError(f"health.every_n_steps must be >= 1, got {every_n_steps}")
        if not rate_window_s > 0:
            raise ValueError(f"health.rate_window_s must be > 0, got {rate_window_s}")
        self.store_path, self.every_n_steps, self.rate_window_s = store_path, every_n_steps, rate_window_s
        self.proxy: Any = None
        self.worker: Any = None
        self.capture_store: SampleStore | None = None
        self._store: SampleStore | None = None
        self._unwatch: Any = None

    def attach(self, proxy: Any = None, worker: Any = None, capture_store: SampleStore | None = None,
               served: Any = None) -> None:  # fmt: skip
        """The live loop's proxy, scoring worker and the store instance the proxy writes through; with `served`
        (what the server serves), the loop's Prometheus series are registered until `teardown`."""
        self.proxy, self.worker, self.capture_store = proxy, worker, capture_store
        if capture_store is not None and self._unwatch is None:
            collector = metrics.LoopCollector(capture_store, served, self.rate_window_s, metrics.AGENTS)
            self._unwatch = metrics.watch_loop(collector)
            log.debug("Loop metrics registered (GET /metrics on the proxy's port)")

    def snapshot(self) -> dict[str, float]:
        """The counters now."""
        if self._store is None:
            self._store = open_store(self.store_path)
        counts = self._store.counts()
        out = {
            "rollout/pending": counts["pending"],
            "rollout/ready": counts["ready"],
            "rollout/backlog": counts["pending"] + counts["ready"],
            "rollout/dropped": counts["dropped"],
        }
        out["rollout/dropped_secret"] = 0  # always logged: turns holding a secret (docs/privacy.md)
        out.update({f"rollout/dropped_{reason}": n for reason, n in self._store.dropped_reasons().items()})
        rates = self._store.rates(self.rate_window_s)
        pace = {"rollout/replies_per_min": "replies_per_min", "rollout/reply_tokens_per_s": "reply_tokens_per_s",
                "train/samples_per_min": "trained_per_min", "train/sample_age_s": "trained_age_s",
                "train/version_lag": "trained_lag"}  # fmt: skip
        out.update({name: rates[key] for name, key in pace.items() if rates[key] is not None})
        if self.proxy is not None:
            out["rollout/captured"] = self.proxy.stats.get("captured", 0)
            out["rollout/capture_failures"] = self.proxy.stats.get("capture_errors", 0)
            out["rollout/skills_only_turns"] = self.proxy.stats.get("skills_only", 0)  # answered, not captured
        if self.capture_store is not None:
            out["rollout/capture_paused"] = self.capture_store.stats["capture_paused"]
        if self.worker is not None:
            out["rollout/judge_failures"] = self.worker.stats.get("judge_failed", 0)
            out["rollout/judge_errors"] = self.worker.stats.get("errors", 0)
            out["rollout/distilled"] = self.worker.stats.get("distilled", 0)  # learning from the words (distill)
            out["rollout/distill_failures"] = self.worker.stats.get("distill_failed", 0)
            distiller = getattr(self.worker, "distiller", None)
            if distiller is not None:  # hinted replies the preference explained but the request did not (`relevance`)
                out["rollout/distill_off_request"] = distiller.stats["off_request"]
                out["rollout/distill_share"] = distiller.pace.share()  # the teacher's time, by what it yields
                out["rollout/distill_duplicates"] = distiller.stats["duplicates"]  # a hinted reply twice: one row
            evolution = getattr(self.worker, "evolution", None)
            if evolution is not None:
                counted = ("evolutions", "accepted", "unusable", "skipped", "quarantined", "dropped_agents", "deferred")
                out.update({f"skills/{k}": evolution.stats[k] for k in counted})
        return {k: float(v) for k, v in out.items()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.is_global_zero:
            metrics.STEPS.inc()
        if not trainer.is_global_zero or trainer.global_step % self.every_n_steps:
            return
        snapshot = self.snapshot()
        for name, value in snapshot.items():
            pl_module.log(name, value, prog_bar=name in PROGRESS_BAR, rank_zero_only=True, batch_size=1)
        log.info("%s", step_line(trainer.global_step, {**_floats(trainer.callback_metrics), **snapshot}))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._unwatch is not None:
            log.debug("Loop metrics unregistered (%s)", stage)
            self._unwatch()
            self._unwatch = None
        if self._store is not None:
            self._store.close()
            self._store = None
