"""A settable clock and a settable idle source for scheduler tests."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta


class FakeClock:
    """`clock()` returns the time it was set to; `advance(minutes=...)` moves it."""

    def __init__(self, now: datetime) -> None:
        self.now, self._lock = now, threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self.now

    def set(self, now: datetime) -> None:
        with self._lock:
            self.now = now

    def advance(self, **delta: float) -> None:
        with self._lock:
            self.now += timedelta(**delta)


class FakeIdle:
    """The user's last input is `last_input` (on the fake clock); `away()` / `back()` move it."""

    name = "fake"

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.last_input = clock, clock()

    def idle_seconds(self, now: datetime) -> float:
        return max(0.0, (now - self.last_input).total_seconds())

    def back(self) -> None:
        self.last_input = self.clock()

    def away(self, minutes: float) -> None:
        self.last_input = self.clock() - timedelta(minutes=minutes)
