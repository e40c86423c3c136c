"""Window sources: each says whether it opens a training window now, and when it opens one next.

A window is an `Interval` (end None: open-ended, e.g. "idle until the user comes back"). Times are aware
datetimes; comparisons happen in UTC, so DST changes of the user's time zone never confuse them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

UTC = timezone.utc


@dataclass(frozen=True)
class Interval:
    """A training window `[start, end)`; `end=None` when it lasts as long as its condition (idle)."""

    start: datetime
    end: datetime | None
    reason: str

    def contains(self, now: datetime) -> bool:
        return self.start <= now and (self.end is None or now < self.end)

    @property
    def minutes(self) -> float | None:
        return None if self.end is None else (self.end - self.start).total_seconds() / 60


class WindowSource(Protocol):
    """What the scheduler combines: sleep hours, idle, calendar events (any object with these methods)."""

    name: str

    def current(self, now: datetime) -> Interval | None:
        """The window this source has open at `now`, if any."""
        ...

    def upcoming(self, now: datetime) -> Interval | None:
        """The next window that starts after `now` (None when not predictable)."""
        ...


def resolve_zone(name: str | None) -> tzinfo:
    """`Europe/Berlin` → its zone; None → the host's zone (`TZ`, then /etc/localtime, then the current offset)."""
    if name:
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError) as e:
            raise ValueError(f"scheduler.timezone: unknown time zone {name!r}") from e
    env = os.environ.get("TZ", "").lstrip(":")
    if env:
        try:
            return ZoneInfo(env)
        except (ZoneInfoNotFoundError, ValueError):
            pass
    localtime = Path("/etc/localtime")
    if localtime.exists():
        try:
            with localtime.open("rb") as fh:
                return ZoneInfo.from_file(fh, key="localtime")
        except (OSError, ValueError):
            pass
    return datetime.now().astimezone().tzinfo or UTC


def parse_clock_time(value: str | time, field: str) -> time:
    """`"23:00"` → `time(23, 0)`; the error names the config field."""
    if isinstance(value, time):
        return value
    try:
        return time.fromisoformat(str(value))
    except ValueError as e:
        raise ValueError(f"scheduler.{field} must be a time of day like '23:00', got {value!r}") from e


def wall_time(day: date, at: time, zone: tzinfo) -> datetime:
    """`day` at wall-clock `at` in `zone`, as a UTC instant (zoneinfo's rules for times DST skips or repeats)."""
    return datetime.combine(day, at, tzinfo=zone).astimezone(UTC)


class SleepHours:
    """Opens a window every night from `start` to `end` (wall-clock, in `zone`); `end < start` crosses midnight."""

    name = "sleep"

    def __init__(self, start: str | time, end: str | time, zone: tzinfo) -> None:
        self.start, self.end = parse_clock_time(start, "sleep_start"), parse_clock_time(end, "sleep_end")
        self.zone = zone
        if self.start == self.end:
            raise ValueError(f"scheduler.sleep_start and sleep_end are both {self.start}: set null to disable")

    def _night(self, day: date) -> Interval:
        end_day = day if self.end > self.start else day + timedelta(days=1)
        label = f"sleep hours {self.start:%H:%M}-{self.end:%H:%M} ({self.zone})"
        return Interval(wall_time(day, self.start, self.zone), wall_time(end_day, self.end, self.zone), label)

    def _nights(self, now: datetime) -> list[Interval]:
        today = now.astimezone(self.zone).date()
        return [self._night(today + timedelta(days=d)) for d in (-1, 0, 1)]

    def current(self, now: datetime) -> Interval | None:
        return next((n for n in self._nights(now) if n.contains(now)), None)

    def upcoming(self, now: datetime) -> Interval | None:
        return next((n for n in self._nights(now) if n.start > now), None)

    def why_closed(self, now: datetime) -> str:
        return f"outside sleep hours {self.start:%H:%M}-{self.end:%H:%M} ({self.zone})"


class IdleSource(Protocol):
    """Seconds since the user's last input (keyboard, mouse, or a request to the proxy)."""

    name: str

    def idle_seconds(self, now: datetime) -> float: ...


class IdleWindow:
    """Opens a window once the user has been idle for `threshold_minutes`; it lasts until they come back."""

    name = "idle"

    def __init__(self, idle: IdleSource, threshold_minutes: float) -> None:
        if threshold_minutes <= 0:
            raise ValueError(f"scheduler.idle_threshold_minutes must be > 0 (or null), got {threshold_minutes}")
        self.idle, self.threshold_s = idle, threshold_minutes * 60

    def current(self, now: datetime) -> Interval | None:
        idle_s = self.idle.idle_seconds(now)
        if idle_s < self.threshold_s:
            return None
        start = now - timedelta(seconds=idle_s - self.threshold_s)
        return Interval(start, None, f"user idle {idle_s / 60:.0f} min ({self.idle.name})")

    def why_closed(self, now: datetime) -> str:
        idle_min = self.idle.idle_seconds(now) / 60
        return f"user active: idle {idle_min:.0f} min < {self.threshold_s / 60:g} min ({self.idle.name})"

    def upcoming(self, now: datetime) -> Interval | None:
        left = self.threshold_s - self.idle.idle_seconds(now)
        if left <= 0:
            return None
        return Interval(now + timedelta(seconds=left), None, f"if the user stays idle ({self.idle.name})")
