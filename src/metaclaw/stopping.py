"""Stopping a run cleanly: SIGTERM / SIGINT, a dead policy server, or a caller (e.g. a control command).

`StopController` is the one place a stop is requested and queried. The data stream stops waiting for samples
(`should_stop`), `GracefulStop` ends `fit` after the step in progress, and with `on_signal=abandon` a signal that
arrives mid-fit abandons the step instead (`RunAbandoned`): its claimed samples go back to `ready` when the store
is reconciled. A second SIGINT raises `KeyboardInterrupt` (the impatient user's way out).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L

log = logging.getLogger(__name__)

ON_SIGNAL = ("finish", "abandon")


class RunAbandoned(Exception):
    """Raised inside `fit` to abandon the step in progress (its samples stay unconsumed)."""


class RunFailed(RuntimeError):
    """The run stopped because a component it needs died; the message says which."""


class StopController:
    """Request and observe a stop of the run.

    Args:
        on_signal: `finish` (the step in progress finishes and is published) or `abandon` (it is dropped and its
            samples are left for the next run).
    """

    def __init__(self, on_signal: str = "finish") -> None:
        if on_signal not in ON_SIGNAL:
            raise ValueError(f"stop.on_signal must be one of {ON_SIGNAL}, got {on_signal!r}")
        self.on_signal = on_signal
        self.event = threading.Event()
        self.reason: str | None = None
        self.error: str | None = None
        self._fitting = False
        self._signals = 0

    @property
    def stopping(self) -> bool:
        return self.event.is_set()

    def should_stop(self) -> bool:
        return self.event.is_set()

    def request(self, reason: str, error: bool = False) -> None:
        """Ask the run to stop; `error=True` makes it end with `RunFailed(reason)` (a non-zero exit)."""
        if error and self.error is None:
            self.error = reason
        if not self.event.is_set():
            self.reason = reason
            (log.error if error else log.warning)("Stopping: %s", reason)
            self.event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.event.wait(timeout)

    def state(self) -> dict[str, Any]:
        return {"stopping": self.stopping, "reason": self.reason, "error": self.error, "on_signal": self.on_signal}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self._signals += 1
        if self._signals > 1 and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.request(f"received {name}")
        if self.on_signal == "abandon" and self._fitting:
            self._fitting = False
            raise RunAbandoned(f"{name}: the step in progress is abandoned")

    @contextmanager
    def signals_installed(self) -> Iterator[StopController]:
        """SIGTERM and SIGINT request a stop while the block runs (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextmanager
    def fitting(self) -> Iterator[None]:
        """Mark the block as `fit`: with `on_signal=abandon`, a signal raises `RunAbandoned` inside it."""
        self._fitting = True
        try:
            yield
        finally:
            self._fitting = False


class GracefulStop(L.Callback):
    """Ends `fit` after the step in progress once a stop was requested."""

    def __init__(self, controller: StopController) -> None:
        self.controller = controller

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.controller.stopping:
            trainer.should_stop = True
