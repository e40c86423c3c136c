"""Calendar meetings open windows: a weekly recurring meeting (RRULE, EXDATE, a moved occurrence, DST), read from
a file or a URL; a malformed calendar stops the scheduler at start with a message naming it."""

from __future__ import annotations

import http.server
import os
import threading
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from metaclaw.scheduler import CalendarError, CalendarWindows, IdleScheduler
from tests.scheduler.fakes import FakeClock

BERLIN = ZoneInfo("Europe/Berlin")
WEEKLY = """BEGIN:VCALENDAR
VERSION:2.0
PRODID:-//metaclaw tests//EN
BEGIN:VEVENT
UID:weekly-sync@test
DTSTAMP:20261001T000000Z
DTSTART;TZID=Europe/Berlin:20261005T140000
DTEND;TZID=Europe/Berlin:20261005T150000
RRULE:FREQ=WEEKLY;BYDAY=MO
EXDATE;TZID=Europe/Berlin:20261116T140000
SUMMARY:Weekly sync
END:VEVENT
BEGIN:VEVENT
UID:weekly-sync@test
RECURRENCE-ID;TZID=Europe/Berlin:20261130T140000
DTSTAMP:20261001T000000Z
DTSTART;TZID=Europe/Berlin:20261130T160000
DTEND;TZID=Europe/Berlin:20261130T170000
SUMMARY:Weekly sync (moved)
END:VEVENT
BEGIN:VEVENT
UID:standup@test
DTSTAMP:20261001T000000Z
DTSTART;TZID=Europe/Berlin:20261005T093000
DTEND;TZID=Europe/Berlin:20261005T094000
RRULE:FREQ=DAILY
SUMMARY:Stand-up (10 min: too short)
END:VEVENT
BEGIN:VEVENT
UID:focus@test
DTSTAMP:20261001T000000Z
DTSTART;TZID=Europe/Berlin:20261124T100000
DTEND;TZID=Europe/Berlin:20261124T120000
TRANSP:TRANSPARENT
SUMMARY:Focus time (free)
END:VEVENT
BEGIN:VEVENT
UID:holiday@test
DTSTAMP:20261001T000000Z
DTSTART;VALUE=DATE:20261125
DTEND;VALUE=DATE:20261126
SUMMARY:Holiday (all day)
END:VEVENT
END:VCALENDAR
"""


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=BERLIN)


def calendar_scheduler(tmp_path, source, clock) -> IdleScheduler:
    return IdleScheduler(
        str(tmp_path),
        sleep_start=None,
        sleep_end=None,
        timezone="Europe/Berlin",
        idle_threshold_minutes=None,
        calendar=str(source),
        min_window_minutes=15,
        clock=clock,
    )


@pytest.fixture
def ics(tmp_path):
    path = tmp_path / "work.ics"
    path.write_text(WEEKLY)
    return path


@pytest.mark.parametrize(
    ("when", "is_open"),
    [
        (at(2026, 11, 23, 13, 59), False),
        (at(2026, 11, 23, 14, 0), True),  # Monday, in the weekly meeting
        (at(2026, 11, 23, 14, 59), True),
        (at(2026, 11, 23, 15, 0), False),
        (at(2026, 11, 24, 14, 30), False),  # Tuesday
        (at(2026, 11, 16, 14, 30), False),  # EXDATE: that week's meeting was cancelled
        (at(2026, 11, 30, 14, 30), False),  # moved to 16:00 that week
        (at(2026, 11, 30, 16, 30), True),
        (at(2026, 10, 19, 14, 30), True),  # before the DST change: still 14:00 Berlin time
        (at(2026, 11, 23, 9, 35), False),  # the daily stand-up is shorter than min_window_minutes
        (at(2026, 11, 24, 11, 0), False),  # marked free
        (at(2026, 11, 25, 11, 0), False),  # all-day events do not count
    ],
)
def test_weekly_recurring_meeting_opens_windows(tmp_path, ics, when, is_open):
    clock = FakeClock(when)
    s = calendar_scheduler(tmp_path, ics, clock)
    window = s.refresh()
    assert window.open is is_open, window.reasons
    if is_open:
        assert window.reasons[0].startswith("in meeting 'Weekly sync")


def test_next_window_is_the_next_meeting_long_enough(tmp_path, ics):
    clock = FakeClock(at(2026, 11, 23, 8, 0))  # before the stand-up and the weekly sync
    s = calendar_scheduler(tmp_path, ics, clock)
    nxt = s.next_window()
    assert nxt.start == at(2026, 11, 23, 14, 0) and nxt.end == at(2026, 11, 23, 15, 0)
    clock.set(at(2026, 11, 23, 15, 30))
    assert s.next_window().start == at(2026, 11, 30, 16, 0)  # a week later, moved


def test_edited_calendar_file_is_reread(tmp_path, ics):
    clock = FakeClock(at(2026, 11, 24, 14, 30))
    s = calendar_scheduler(tmp_path, ics, clock)
    assert not s.refresh().open
    ics.write_text(WEEKLY.replace("BYDAY=MO", "BYDAY=MO,TU"))
    os.utime(ics, (1, 1))  # a different mtime whatever the file system's resolution
    assert s.refresh().open


def test_calendar_from_a_url(tmp_path):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = WEEKLY.encode()
            self.send_response(200)
            self.send_header("content-type", "text/calendar")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cal.ics"
        s = calendar_scheduler(tmp_path, url, FakeClock(at(2026, 11, 23, 14, 30)))
        assert s.refresh().open
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("this is not a calendar", "not a valid iCalendar file"),
        ("BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART:2026-11-XX\nSUMMARY:x\nEND:VEVENT\nEND:VCALENDAR\n", "DTSTART"),
        (
            "BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART:20261123T140000Z\nRRULE:FREQ=SOMETIMES\nEND:VEVENT\nEND:VCALENDAR\n",
            "cannot expand",
        ),
        ("BEGIN:VCALENDAR\nBEGIN:VEVENT\nSUMMARY:no start\nEND:VEVENT\nEND:VCALENDAR\n", "has no DTSTART"),
    ],
)
def test_malformed_calendar_is_a_clear_error_at_start(tmp_path, text, problem):
    bad = tmp_path / "bad.ics"
    bad.write_text(text)
    with pytest.raises(CalendarError, match=problem) as err:
        calendar_scheduler(tmp_path, bad, FakeClock(at(2026, 11, 23, 12, 0)))
    assert "scheduler.calendar" in str(err.value) and str(bad) in str(err.value)


def test_missing_calendar_and_unreachable_url(tmp_path):
    with pytest.raises(CalendarError, match="cannot read it"):
        CalendarWindows(str(tmp_path / "nope.ics"), BERLIN)
    with pytest.raises(CalendarError, match="cannot fetch it"):
        CalendarWindows("http://127.0.0.1:9/cal.ics", BERLIN, timeout_s=2)


def test_a_broken_edit_keeps_the_last_good_calendar(tmp_path, ics, caplog):
    clock = FakeClock(at(2026, 11, 23, 14, 30))
    s = calendar_scheduler(tmp_path, ics, clock)
    ics.write_text("garbage")
    os.utime(ics, (2, 2))
    assert s.refresh().open and "keeping the calendar read before" in caplog.text
