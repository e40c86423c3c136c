"""Busy events from an iCalendar file or URL open training windows: while the user sits in a meeting, the
machine is theirs to train on. Recurring events (RRULE, RDATE, EXDATE, moved occurrences) are expanded by
`recurring-ical-events` on top of `icalendar`; nothing here parses iCalendar by hand.

Counted: timed events that are not cancelled and not marked free (`TRANSP:TRANSPARENT`). All-day events
(holidays, birthdays) say nothing about the user being away and are ignored. Floating times are read in the
scheduler's time zone. Overlapping events merge into one window.

A calendar is untrusted input (anyone who can send the user an invite writes into it), so expansion is bounded
before it runs (`rule_cost`): FREQ=SECONDLY/MINUTELY rules are ignored (no meeting recurs every minute), and a rule
whose expansion from its DTSTART to the end of the horizon would walk more than `max_rule_expansion` candidate
occurrences, or push the calendar past `max_total_expansion`, is ignored too; each ignored event is logged and
shown in `status`. A URL is read as a stream and dropped as soon as it passes `max_bytes`, and later refreshes of
a URL run on a thread of their own, so `status` / `pause` never wait on the network.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from datetime import date, datetime, timedelta, tzinfo
from pathlib import Path

import httpx

try:  # metaclaw[calendar]
    import icalendar
    import recurring_ical_events
except ModuleNotFoundError:  # the scheduler works without it; a configured calendar says what to install
    icalendar = recurring_ical_events = None  # type: ignore[assignment]

from metaclaw.scheduler.ical_guard import screen_recurrences
from metaclaw.scheduler.sources import UTC, Interval

log = logging.getLogger(__name__)


class CalendarError(ValueError):
    """The calendar cannot be read or parsed; the message names the source and the problem."""


# How long one period of a rule is, and how many days dateutil walks per period (the candidates it filters).
_PERIOD_S = {"HOURLY": 3600, "DAILY": 86400, "WEEKLY": 7 * 86400, "MONTHLY": 31 * 86400, "YEARLY": 366 * 86400}
_DAYS_PER_PERIOD = {"HOURLY": 1, "DAILY": 1, "WEEKLY": 7, "MONTHLY": 31, "YEARLY": 366}
REFUSED_FREQS = ("SECONDLY", "MINUTELY")


def _utc(value: object, zone: tzinfo) -> datetime | None:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=zone)).astimezone(UTC)
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=zone).astimezone(UTC)
    return None


def rule_cost(event: icalendar.cal.Component, until: datetime, zone: tzinfo) -> float:
    """An upper estimate of the candidate occurrences expanding `event`'s RRULEs up to `until` walks (0: none).

    The expansion starts at DTSTART whatever window is asked for, so the cost is the number of periods from
    DTSTART to `until` (or the rule's UNTIL) over its INTERVAL, times the days walked per period, times the times
    of day each day expands to (BYHOUR x BYMINUTE x BYSECOND). `inf` for FREQ=SECONDLY/MINUTELY.
    """
    rules = [r for key in ("RRULE", "EXRULE") for r in _as_list(event.get(key))]  # an EXRULE is expanded too
    if not rules:
        return 0.0
    try:
        return _cost(rules, _utc(event.decoded("DTSTART"), zone), until, zone)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError):
        return math.inf  # a rule we cannot size is a rule we do not expand


def _as_list(value: object) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def _cost(rules: list, start: datetime | None, until: datetime, zone: tzinfo) -> float:
    if start is None:
        return 0.0
    total = 0.0
    for rule in rules:
        if not isinstance(rule, icalendar.vRecur):
            continue  # a broken rule: the expansion reports it
        freq = str((rule.get("FREQ") or [""])[0]).upper()
        if freq in REFUSED_FREQS:
            return math.inf
        if freq not in _PERIOD_S:
            continue  # not a frequency at all: the expansion reports the broken rule
        end = until
        for value in rule.get("UNTIL") or []:
            end = min(end, _utc(value, zone) or end)
        interval = max(1, int((rule.get("INTERVAL") or [1])[0]))
        periods = max(0.0, (end - start).total_seconds()) / (_PERIOD_S[freq] * interval) + 1
        times = len(rule.get("BYMINUTE") or [0]) * len(rule.get("BYSECOND") or [0])
        if freq != "HOURLY":
            times *= len(rule.get("BYHOUR") or [0])
        total += periods * _DAYS_PER_PERIOD[freq] * times
    return total


@dataclass(frozen=True)
class CalendarLimits:
    """The bounds a calendar is read within (`CalendarWindows`'s arguments of the same names)."""

    max_bytes: int = 10 * 1024 * 1024
    max_events: int = 10000
    max_rule_expansion: int = 50_000
    max_total_expansion: int = 200_000
    timeout_s: float = 30.0


class CalendarWindows:
    """Meetings from `source` (a path or an http(s)/webcal URL) as training windows.

    Args:
        source: the `.ics` file or URL.
        zone: the zone floating (zone-less) times are read in.
        refresh_minutes: re-read a URL this often (a file: whenever it changes); a failed refresh keeps the
            last good calendar and says so.
        horizon_days: how far ahead occurrences are expanded (and "next window" looks).
        max_bytes: a larger calendar is refused (a URL stops being read once past it).
        max_events: windows in the horizon at most; more: the expansion is refused.
        max_rule_expansion: a recurring event whose expansion would walk more candidate occurrences than this
            (`rule_cost`: a daily rule over 137 years, an hourly one over 5.7) is ignored, logged and shown.
        max_total_expansion: the same bound over all recurring events together (the costliest go first).
        timeout_s: connect / read timeout of a URL.
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
        max_rule_expansion: int = 50_000,
        max_total_expansion: int = 200_000,
        timeout_s: float = 30.0,
        clock_now: datetime | None = None,
    ) -> None:
        if icalendar is None or recurring_ical_events is None:
            raise CalendarError(f"scheduler.calendar {source}: reading a calendar needs the calendar extra: "
                                "pip install 'metaclaw[calendar]'")  # fmt: skip
        self.source, self.zone = str(source), zone
        self.refresh = timedelta(minutes=refresh_minutes)
        self.horizon = timedelta(days=horizon_days)
        self.limits = CalendarLimits(max_bytes, max_events, max_rule_expansion, max_total_expansion, timeout_s)
        self.ignored: list[str] = []  # recurring events left out by the expansion bounds, for `status`
        self._screened_out: list[str] = []  # components `screen_recurrences` left out of the last file read
        self._fetch: threading.Thread | None = None  # a URL refresh in flight
        self._fetched: icalendar.Calendar | CalendarError | None = None
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
            data = self._fetch_url(url)
        else:
            path = Path(self.source).expanduser()
            try:
                self._mtime = path.stat().st_mtime
                data = path.read_bytes()
            except OSError as e:
                raise CalendarError(f"scheduler.calendar {self.source}: cannot read it: {e}") from e
        if len(data) > self.limits.max_bytes:
            raise CalendarError(f"scheduler.calendar {self.source}: {len(data)} bytes, over {self.limits.max_bytes}")
        return data

    def _fetch_url(self, url: str) -> bytes:
        """GET `url`, reading at most `max_bytes` (declared or streamed): a huge or endless body is cut off."""
        chunks, seen = [], 0
        try:
            with httpx.stream("GET", url, timeout=self.limits.timeout_s, follow_redirects=True) as r:
                r.raise_for_status()
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.limits.max_bytes:
                    limit = self.limits.max_bytes
                    raise CalendarError(f"scheduler.calendar {self.source}: {declared} bytes, over {limit}")
                for chunk in r.iter_bytes():
                    seen += len(chunk)
                    if seen > self.limits.max_bytes:
                        raise CalendarError(f"scheduler.calendar {self.source}: over {self.limits.max_bytes} bytes")
                    chunks.append(chunk)
        except httpx.HTTPError as e:
            raise CalendarError(f"scheduler.calendar {self.source}: cannot fetch it: {e}") from e
        return b"".join(chunks)

    def _load(self) -> icalendar.Calendar:
        data, self._screened_out = screen_recurrences(self._read())  # before icalendar expands any VTIMEZONE
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

    def _bounded(self, end: datetime) -> icalendar.Calendar:
        """The calendar without the recurring events whose expansion up to `end` would cost over the bounds."""
        costs = [(rule_cost(ev, end, self.zone), i) for i, ev in enumerate(self._calendar.subcomponents)
                 if ev.name == "VEVENT"]  # fmt: skip
        dropped, total = set(), 0.0
        for cost, i in sorted(costs):
            if cost > self.limits.max_rule_expansion or total + cost > self.limits.max_total_expansion:
                dropped.add(i)
            else:
                total += cost
        ignored = []
        for i in sorted(dropped):
            ev = self._calendar.subcomponents[i]
            key = "RRULE" if ev.get("RRULE") is not None else "EXRULE"
            rule = _as_list(ev.get(key))[0].to_ical().decode(errors="replace")[:80]
            ignored.append(f"{str(ev.get('SUMMARY', '?'))[:60]!r} ({key}:{rule})")
        if ignored != self.ignored and ignored:
            log.warning(
                "scheduler.calendar %s: ignoring %d recurring event(s) whose expansion is unbounded or too costly "
                "(FREQ=SECONDLY/MINUTELY, or over %d candidates each / %d in all): %s",
                self.source, len(ignored), self.limits.max_rule_expansion, self.limits.max_total_expansion,
                "; ".join(ignored),
            )  # fmt: skip
        ignored = self._screened_out + ignored
        if ignored != self.ignored and self._screened_out:
            log.warning("scheduler.calendar %s: left out before parsing (unbounded recurrences): %s", self.source,
                        "; ".join(self._screened_out))  # fmt: skip
        self.ignored = ignored
        if not dropped:
            return self._calendar
        kept = icalendar.Calendar()
        for key, value in self._calendar.items():
            kept.add(key, value)
        kept.subcomponents = [c for i, c in enumerate(self._calendar.subcomponents) if i not in dropped]
        return kept

    def _expand(self, now: datetime) -> None:
        start, end = now - timedelta(days=1), now + self.horizon
        try:
            events = recurring_ical_events.of(self._bounded(end)).between(start, end)
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
            if len(spans) > self.limits.max_events:
                raise CalendarError(f"scheduler.calendar {self.source}: over {self.limits.max_events} events in range")
        self._intervals = _merge(sorted(spans))
        self._span = (start, end)

    def _refresh_url(self) -> None:
        """Fetch and parse on a thread of its own; the next `_maybe_refresh` picks the result up."""
        try:
            self._fetched = self._load()
        except CalendarError as e:
            self._fetched = e

    def _maybe_refresh(self, now: datetime) -> None:
        changed = False
        if self.is_url:
            if self._fetch is not None and not self._fetch.is_alive():
                fetched, self._fetch, self._fetched = self._fetched, None, None
                if isinstance(fetched, CalendarError):
                    log.error("%s; keeping the calendar read before", fetched)
                elif fetched is not None:
                    self._calendar, changed = fetched, True
            if self._fetch is None and (self._loaded_at is None or now - self._loaded_at >= self.refresh):
                self._loaded_at = now
                self._fetch = threading.Thread(target=self._refresh_url, name="metaclaw-calendar", daemon=True)
                self._fetch.start()
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
        """Every window in the expanded range (what the calendar tests read)."""
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
