"""`IdleScheduler`: a Lightning callback that lets optimizer steps happen only inside training windows.

The gate sits in the datamodule's claim path (`RolloutDataModule.gate`): before a step's samples are claimed
the dataset blocks until a window is open, so nothing is claimed while the window is closed and samples keep
accumulating as `ready`. Lightning fetches one batch ahead, so the batch after a running step is claimed while
that step runs; when the user comes back mid-step, the step finishes and its adapter is published
(`on_user_return: finish`), then the next claim waits; with `abandon` the step's update is skipped and its
samples go back to `ready`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import lightning as L

from metaclaw.scheduler.calendar import CalendarWindows
from metaclaw.scheduler.idle import ActivityTracker, CombinedIdle, detect_host_idle
from metaclaw.scheduler.sources import UTC, IdleWindow, Interval, SleepHours, WindowSource, resolve_zone
from metaclaw.scheduler.state import SchedulerState
from metaclaw.store import open_store

log = logging.getLogger(__name__)
STATE_FILE = "scheduler_state.json"


@dataclass
class Window:
    """Whether training may run now, and why (or why not)."""

    open: bool
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WindowRules:
    """How windows open and how the trainer meets them (`IdleScheduler`'s arguments of the same names)."""

    min_window_minutes: float = 15.0
    train_now_minutes: float = 60.0
    on_user_return: str = "finish"
    poll_s: float = 5.0


@dataclass
class TrainerLink:
    """The trainer the scheduler gates: its thread, whether its datamodule waits for windows, what it waited."""

    trainer: L.Trainer | None = None
    thread: threading.Thread | None = None
    gating_datamodule: bool = False  # the datamodule calls `wait_until_open` before each claim
    pending_metrics: dict[str, float] = field(default_factory=dict)  # logged from the trainer's thread
    waited_s: float = 0.0


class IdleScheduler(L.Callback):
    """Training windows from sleep hours, user idle time and calendar meetings (any one opens a window).

    Args:
        run_dir: where `scheduler_state.json` lives (pause / train-now / last window survive restarts).
        store_path: the sample store (`sched/samples_waiting`); None: not reported.
        sleep_start, sleep_end: nightly window, wall-clock `HH:MM` in `timezone`; null disables it.
        timezone: IANA zone (`Europe/Berlin`); null: the host's zone.
        idle_threshold_minutes: the user counts as away after this long without input; null disables it.
        idle_source: `auto` (first host source that works, detected at start), `x11`, `logind`, `macos`,
            `windows`, `proxy` (the proxy's last request only), or an object with `name` and `idle_seconds(now)`.
        calendar: an `.ics` path or http(s)/webcal URL whose meetings open windows; null: none.
        calendar_refresh_minutes: how often a calendar URL is re-fetched.
        min_window_minutes: sleep / meeting windows shorter than this never open.
        train_now_minutes: how long `train-now` keeps a window open.
        on_user_return: `finish` (the step in progress completes and is published) or `abandon` (its update is
            skipped and its samples are released).
        poll_s: how often a closed window is re-checked while waiting (waits block; they never spin).
        clock: returns the current aware datetime (tests pass a fake one).
        should_stop: the run's stop request (`StopController.should_stop`): it ends a wait for a window.
        ungated: many agents (docs/agents.md): adapters of `rl` agents, which step outside windows too.

    The datamodule that claims samples takes `wait_until_open` as its `gate` (blocks before every claim); with any
    other datamodule, steps are gated at batch start.
    """

    def __init__(
        self,
        run_dir: str,
        store_path: str | None = None,
        sleep_start: str | None = "23:00",
        sleep_end: str | None = "07:00",
        timezone: str | None = None,
        idle_threshold_minutes: float | None = 30.0,
        idle_source: Any = "auto",
        calendar: str | None = None,
        calendar_refresh_minutes: float = 15.0,
        min_window_minutes: float = 15.0,
        train_now_minutes: float = 60.0,
        on_user_return: str = "finish",
        poll_s: float = 5.0,
        clock: Callable[[], datetime] | None = None,
        should_stop: Callable[[], bool] | None = None,
        ungated: Collection[str] = (),
    ) -> None:
        if on_user_return not in ("finish", "abandon"):
            raise ValueError(f"scheduler.on_user_return must be 'finish' or 'abandon', got {on_user_return!r}")
        if (sleep_start is None) != (sleep_end is None):
            raise ValueError("scheduler.sleep_start and scheduler.sleep_end must both be set or both be null")
        if min_window_minutes < 0 or train_now_minutes <= 0 or poll_s <= 0:
            raise ValueError("scheduler.min_window_minutes >= 0, train_now_minutes > 0 and poll_s > 0 are required")
        self.clock = clock or (lambda: datetime.now(UTC))
        self.zone = resolve_zone(timezone)
        self.state_path = Path(run_dir) / STATE_FILE
        self.store_path = store_path
        self.rules = WindowRules(min_window_minutes, train_now_minutes, on_user_return, poll_s)
        self.activity = ActivityTracker(self.clock)  # touched by the proxy on every /v1 request
        self.sources: list[WindowSource] = []
        if sleep_start is not None:
            self.sources.append(SleepHours(sleep_start, sleep_end, self.zone))
        self.idle_name = None
        if idle_threshold_minutes is not None:
            host = detect_host_idle(idle_source) if isinstance(idle_source, str) else idle_source
            idle = CombinedIdle(host, self.activity)
            self.idle_name = idle.name
            self.sources.append(IdleWindow(idle, idle_threshold_minutes))
        if calendar:
            self.sources.append(CalendarWindows(calendar, self.zone, calendar_refresh_minutes, clock_now=self.clock()))
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.should_stop: Callable[[], bool] = should_stop or (lambda: False)
        self.ungated = frozenset(ungated)
        self.state = SchedulerState.load(self.state_path)
        self.bound = TrainerLink()
        log.info(
            "Scheduler: %s; state %s",
            ", ".join(self._describe()) or "no window source (always open)",
            "paused" if self.state.paused else "running",
        )

    def _describe(self) -> list[str]:
        out = []
        for s in self.sources:
            if isinstance(s, SleepHours):
                out.append(f"sleep {s.start:%H:%M}-{s.end:%H:%M} {self.zone}")
            elif isinstance(s, IdleWindow):
                out.append(f"idle >= {s.threshold_s / 60:g} min ({self.idle_name})")
            elif isinstance(s, CalendarWindows):
                n, some = len(s.ignored), "; ".join(s.ignored[:3])
                ignored = f" ({n} recurring event(s) ignored as unbounded: {some})" if n else ""
                out.append(f"meetings in {s.source}{ignored}")
        return out

    # ---- windows ------------------------------------------------------------------------------------------
    def _long_enough(self, interval: Interval) -> bool:
        return interval.minutes is None or interval.minutes >= self.rules.min_window_minutes

    def evaluate(self, now: datetime | None = None) -> Window:
        """The window at `now` (no side effects)."""
        now = now or self.clock()
        if self.state.paused:
            return Window(False, ["paused (resume with: python -m metaclaw resume)"])
        reasons = []
        until = self.state.train_now_until
        if until and now < datetime.fromisoformat(until):
            reasons.append(f"train-now until {until}")
        closed = []
        for source in self.sources:
            interval = source.current(now)
            if interval is not None and self._long_enough(interval):
                reasons.append(interval.reason)
            elif interval is not None:
                closed.append(f"{interval.reason} is shorter than min_window_minutes={self.rules.min_window_minutes:g}")
            else:
                why = getattr(source, "why_closed", None)
                closed.append(why(now) if why else f"no {source.name} window")
        if not self.sources:
            reasons.append("no window source configured: always open")
        return Window(True, reasons) if reasons else Window(False, closed)

    def next_window(self, now: datetime | None = None) -> Interval | None:
        """The earliest upcoming window that is long enough (None if none is predictable)."""
        now = now or self.clock()
        best: Interval | None = None
        for source in self.sources:
            at, candidate = now, None
            for _ in range(64):  # skip windows that are too short
                candidate = source.upcoming(at)
                if candidate is None or self._long_enough(candidate):
                    break
                at, candidate = candidate.start, None
            if candidate is not None and (best is None or candidate.start < best.start):
                best = candidate
        return best

    def refresh(self) -> Window:
        """Evaluate now; on a change, persist it, log it and report `sched/window_open`."""
        now = self.clock()
        window = self.evaluate(now)
        with self._lock:
            if window.open != self.state.window_open or (window.open and window.reasons != self.state.window_reasons):
                if window.open != self.state.window_open:
                    log.info("Training window %s: %s", "open" if window.open else "closed", "; ".join(window.reasons))
                    self.state.window_since = now.isoformat()
                self.state.window_open, self.state.window_reasons = window.open, window.reasons
                self._save(now)
                self._log_metrics({"sched/window_open": float(window.open)})
        return window

    # ---- waiting ------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Release every wait (the service is shutting down)."""
        self._stop.set()
        self._wake.set()

    def _stopping(self) -> bool:
        t = self.bound.trainer
        trainer_stops = t is not None and bool(t.should_stop or getattr(t, "received_sigterm", False))
        return self._stop.is_set() or trainer_stops or self.should_stop()

    def wait_until_open(self) -> bool:
        """Block until a window is open; False when the service is stopping instead. Never spins."""
        started, announced = time.monotonic(), False
        while not self._stopping():
            window = self.refresh()
            if window.open:
                waited = time.monotonic() - started
                self.bound.waited_s += waited
                if announced:
                    log.info("Training resumes after %.0f s: %s", waited, "; ".join(window.reasons))
                return True
            if not announced:
                nxt = self.next_window()
                log.info(
                    "Training waits (%s); next window %s",
                    "; ".join(window.reasons),
                    f"{nxt.start.isoformat()} ({nxt.reason})" if nxt else "not predictable",
                )
                announced = True
            deadline = time.monotonic() + self.rules.poll_s
            while not self._stopping() and not self._wake.is_set() and time.monotonic() < deadline:
                self._wake.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            self._wake.clear()
        return False

    # ---- control ------------------------------------------------------------------------------------------
    def _save(self, now: datetime | None = None) -> None:
        self.state.updated_at = (now or self.clock()).isoformat()
        self.state.save(self.state_path)

    def _change(self, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self.state, k, v)
            self._save()
        self._wake.set()
        self.refresh()

    def pause(self) -> None:
        """No training until `resume` (survives restarts); a step in progress finishes."""
        self._change(paused=True, train_now_until=None)

    def resume(self) -> None:
        self._change(paused=False, rollback_step=None, rollback_agent=None)

    def record_rollback(self, step: int, agent: str | None = None) -> None:
        """Remember (across restarts) that the served adapter (`agent`'s own, None: the default one) was rolled
        back to `step`; pauses training."""
        self._change(paused=True, train_now_until=None, rollback_step=step, rollback_agent=agent)

    def train_now(self, minutes: float | None = None) -> datetime:
        """Open a window now for `minutes` (default `train_now_minutes`), whatever the sources say."""
        until = self.clock() + timedelta(minutes=minutes or self.rules.train_now_minutes)
        self._change(paused=False, train_now_until=until.astimezone(timezone.utc).isoformat())
        return until

    def status(self) -> dict[str, Any]:
        """What `python -m metaclaw status` shows about the window."""
        window = self.refresh()
        nxt = None if self.state.paused else self.next_window()
        return {
            "open": window.open,
            "reasons": window.reasons,
            "since": self.state.window_since,
            "paused": self.state.paused,
            "train_now_until": self.state.train_now_until,
            "next_window": None if nxt is None else {
                "start": nxt.start.isoformat(),
                "end": None if nxt.end is None else nxt.end.isoformat(),
                "reason": nxt.reason,
            },
            "sources": self._describe(),
            "min_window_minutes": self.rules.min_window_minutes,
            "on_user_return": self.rules.on_user_return,
            "waited_s": round(self.bound.waited_s, 1),
        }  # fmt: skip

    # ---- Lightning hooks ----------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.bound.trainer, self.bound.thread = trainer, threading.current_thread()
        self.bound.gating_datamodule = getattr(trainer.datamodule, "gate", None) == self.wait_until_open
        if not self.bound.gating_datamodule:
            log.warning("Scheduler: the datamodule does not take wait_until_open as its claim gate; steps are gated "
                        "at batch start instead")  # fmt: skip

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if not self.bound.gating_datamodule:
            self.wait_until_open()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.rules.on_user_return != "abandon" or getattr(pl_module, "current_adapter", None) in self.ungated:
            return  # an `rl` agent's step (many agents) is not bound to windows
        # rank 0 decides for every rank: replicas that stepped differently would drift apart
        if trainer.strategy.broadcast(self.refresh().open, src=0):
            return
        optimizer.zero_grad(set_to_none=True)  # no gradient: the optimizer leaves every weight as it was
        if self.store_path and trainer.is_global_zero:
            released = open_store(self.store_path).release_claims(trainer.global_step)
            log.info("User came back mid-step %d: step abandoned, %d samples released", trainer.global_step, released)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        metrics = {"sched/window_open": float(self.state.window_open), "sched/waited_s": self.bound.waited_s}
        if self.store_path:
            store = open_store(self.store_path)
            try:
                metrics["sched/samples_waiting"] = float(store.count("ready"))
            finally:
                store.close()
        self._log_metrics(metrics)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.bound.trainer = None

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        """Log through the trainer's loggers, from the trainer's thread only (a control request's change is
        logged by the trainer at its next check)."""
        with self._lock:
            self.bound.pending_metrics.update(metrics)
            trainer = self.bound.trainer
            if trainer is None or threading.current_thread() is not self.bound.thread:
                return
            metrics, self.bound.pending_metrics = self.bound.pending_metrics, {}
        if trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=trainer.global_step)
