"""Busy events from an iCalendar file or URL open training windows: while the user sits in a meeting, the
machine is theirs to train on. Recurring events (RRULE, RDATE, EXDATE, moved occurrences) are expanded by
`recurring-ical-events` on top of `icalendar`; nothing here parses iCalendar by hand.

Counted: timed events that are not cancelled and not marked free (`TRANSP:TRANSPARENT`). All-day events
(holidays, birthdays) say nothing about the user being away and are ignored. Floating times are read in the
scheduler's time zone. Overlapping events merge into one window.
"""

from __future__ import annotations

import logging
from datetime import date, datetime, timedelta, tzinfo
from pathlib import Path

import httpx
import icalendar
import recurring_ical_events

from metaclaw.scheduler.sources import UTC, Interval

log = logging.getLogger(__name__)


class CalendarError(ValueError):
    """The calendar cannot be read or parsed; the message names the source and the problem."""


class CalendarWindows:
    """Meetings from `source` (a path or an http(s)/webcal URL) as training windows.

    Args:
        source: the `.ics` file or URL.
        zone: the zone floating (zone-less) times are read in.
        refresh_minutes: re-read a URL this often (a file: whenever it changes); a failed refresh keeps the
            last good calendar and says so.
        horizon_days: how far ahead occurrences are expanded (and "next window" looks).
        max_bytes: a larger calendar is refused.
        clock_now: the time used for the check at start.
    """

    name = "calendar"

    def __init__(
        self,
        source: str,
        zone: tzinfo,
        refresh_minutes: float = 15.0,
        horizon_days: int = 8,
        max_bytes: int = 10 * 1024 * 1024,
        max_events: int = 10000,
        timeout_s: float = 30.0,
        clock_now: datetime | None = None,
    ) -> None:
        self.source, self.zone = str(source), zone
        self.refresh = timedelta(minutes=refresh_minutes)
        self.horizon, self.max_bytes, self.max_events, self.timeout_s = (
            timedelta(days=horizon_days), max_bytes, max_events, timeout_s)  # fmt: skip
        self._calendar: icalendar.Calendar | None = None
        self._loaded_at: datetime | None = None
        self._mtime: float | None = None
        self._intervals: list[Interval] = []
        self._span: tuple[datetime, datetime] | None = None
        now = clock_now or datetime.now(UTC)
        self._calendar = self._load()  # raises CalendarError: a broken calendar stops the service at start
        self._loaded_at = now
        self._expand(now)

    @property
    def is_url(self) -> bool:
        return self.source.split(":", 1)[0].lower() in ("http", "https", "webcal")

    def _read(self) -> bytes:
        if self.is_url:
            url = "https:" + self.source.split(":", 1)[1] if self.source.lower().startswith("webcal:") else self.source
            try:
                r = httpx.get(url, timeout=self.timeout_s, follow_redirects=True)
                r.raise_for_status()
            except httpx.HTTPError as e:
                raise CalendarError(f"scheduler.calendar {self.source}: cannot fetch it: {e}") from e
            data = r.content
        else:
            path = Path(self.source).expanduser()
            try:
                self._mtime = path.stat().st_mtime
                data = path.read_bytes()
            except OSError as e:
                raise CalendarError(f"scheduler.calendar {self.source}: cannot read it: {e}") from e
        if len(data) > self.max_bytes:
            raise CalendarError(f"scheduler.calendar {self.source}: {len(data)} bytes, over {self.max_bytes}")
        return data

    def _load(self) -> icalendar.Calendar:
        data = self._read()
        try:
            cal = icalendar.Calendar.from_ical(data)
        except (ValueError, IndexError, KeyError, TypeError) as e:
            raise CalendarError(f"scheduler.calendar {self.source}: not a valid iCalendar file: {e}") from e
        if not isinstance(cal, icalendar.Calendar) or cal.name != "VCALENDAR":
            raise CalendarError(f"scheduler.calendar {self.source}: no VCALENDAR in it")
        for event in cal.walk("VEVENT"):
            if event.get("DTSTART") is None:
                raise CalendarError(
                    f"scheduler.calendar {self.source}: event {str(event.get('SUMMARY', '?'))!r} has no DTSTART"
                )
        return cal

    def _as_utc(self, value: date | datetime) -> datetime | None:
        if not isinstance(value, datetime):
            return None  # all-day
        return (value if value.tzinfo else value.replace(tzinfo=self.zone)).astimezone(UTC)

    def _expand(self, now: datetime) -> None:
        start, end = now - timedelta(days=1), now + self.horizon
        try:
            events = recurring_ical_events.of(self._calendar).between(start, end)
        except Exception as e:  # noqa: BLE001 - the library raises many types for broken rules
            raise CalendarError(f"scheduler.calendar {self.source}: cannot expand its events: {e}") from e
        spans: list[tuple[datetime, datetime, str]] = []
        for ev in events:
            if str(ev.get("TRANSP", "OPAQUE")).upper() == "TRANSPARENT":
                continue
            if str(ev.get("STATUS", "")).upper() == "CANCELLED":
                continue
            try:
                s, e = self._as_utc(ev.start), self._as_utc(ev.end)
            except (ValueError, KeyError, TypeError) as err:
                raise CalendarError(f"scheduler.calendar {self.source}: bad event times: {err}") from err
            if s is None or e is None or e <= s:
                continue
            spans.append((s, e, str(ev.get("SUMMARY", "busy"))))
            if len(spans) > self.max_events:
                raise CalendarError(f"scheduler.calendar {self.source}: over {self.max_events} events in range")
        self._intervals = _merge(sorted(spans))
        self._span = (start, end)

    def _maybe_refresh(self, now: datetime) -> None:
        changed = False
        if self.is_url:
            changed = self._loaded_at is None or now - self._loaded_at >= self.refresh
        else:
            try:
                changed = Path(self.source).expanduser().stat().st_mtime != self._mtime
            except OSError:
                changed = False
        if changed:
            try:
                self._calendar = self._load()
            except CalendarError as e:
                log.error("%s; keeping the calendar read before", e)
            self._loaded_at = now
        if changed or self._span is None or now > self._span[1] - self.horizon / 2 or now < self._span[0]:
            try:
                self._expand(now)
            except CalendarError as e:
                log.error("%s; keeping the windows computed before", e)

    def current(self, now: datetime) -> Interval | None:
        self._maybe_refresh(now)
        return next((i for i in self._intervals if i.contains(now)), None)

    def upcoming(self, now: datetime) -> Interval | None:
        self._maybe_refresh(now)
        return next((i for i in self._intervals if i.start > now), None)

    def why_closed(self, now: datetime) -> str:
        return "no meeting now"

    def intervals(self, now: datetime) -> list[Interval]:
        """Every window in the expanded range (for tests and `status`)."""
        self._maybe_refresh(now)
        return list(self._intervals)


def _merge(spans: list[tuple[datetime, datetime, str]]) -> list[Interval]:
    merged: list[list] = []
    for s, e, summary in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
            if summary not in merged[-1][2]:
                merged[-1][2].append(summary)
        else:
            merged.append([s, e, [summary]])
    return [Interval(s, e, "in meeting " + ", ".join(repr(x) for x in names)) for s, e, names in merged]
