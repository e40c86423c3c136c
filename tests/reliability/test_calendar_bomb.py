"""Issue 31, finding 5: a 167-byte invite (`FREQ=SECONDLY` from 1970) stalled the scheduler, and a calendar URL was
read whole before its size check. Recurrence expansion is bounded before it runs; a URL is cut off at `max_bytes`.

Each load runs in a thread with a generous join timeout so that a regression fails instead of hanging the suite;
the assertions are on what came back, not on how long it took.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from metaclaw.scheduler import CalendarError, CalendarWindows, IdleScheduler
from metaclaw.scheduler.sources import UTC

BERLIN = ZoneInfo("Europe/Berlin")
NOW = datetime(2026, 11, 23, 14, 30, tzinfo=BERLIN)  # a Monday, inside the weekly meeting below
BOMB = (  # the shape of the issue's 167-byte file
    "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:x\r\nBEGIN:VEVENT\r\nUID:a@x\r\nDTSTAMP:19700101T000000Z\r\n"
    "DTSTART:19700101T000000Z\r\nDTEND:19700101T000001Z\r\nRRULE:FREQ=SECONDLY\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"
)
WEEKLY = (
    "BEGIN:VEVENT\r\nUID:sync@x\r\nDTSTAMP:20261001T000000Z\r\nDTSTART;TZID=Europe/Berlin:20261005T140000\r\n"
    "DTEND;TZID=Europe/Berlin:20261005T150000\r\nRRULE:FREQ=WEEKLY;BYDAY=MO\r\nSUMMARY:Weekly sync\r\nEND:VEVENT\r\n"
)


def _event(uid: str, rule: str, start: str = "19700101T000000Z") -> str:
    return (f"BEGIN:VEVENT\r\nUID:{uid}\r\nDTSTAMP:19700101T000000Z\r\nDTSTART:{start}\r\n"
            f"DURATION:PT30M\r\nRRULE:{rule}\r\nSUMMARY:{uid}\r\nEND:VEVENT\r\n")  # fmt: skip


def _calendar(*events: str) -> str:
    return "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:x\r\n" + "".join(events) + "END:VCALENDAR\r\n"


def _in_thread(fn: Callable[[], object], timeout: float = 120.0) -> object:
    """Run `fn` in a daemon thread; its result or exception, or fail if it is still running after `timeout`."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the calendar is still being expanded (unbounded recurrence)"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


def test_the_issues_167_byte_invite_is_ignored_not_expanded(tmp_path) -> None:
    path = tmp_path / "bomb.ics"
    path.write_text(BOMB, newline="")
    assert path.stat().st_size < 200
    cal = _in_thread(lambda: CalendarWindows(str(path), UTC, clock_now=NOW))
    assert cal.intervals(NOW) == []
    assert len(cal.ignored) == 1 and "FREQ=SECONDLY" in cal.ignored[0]


@pytest.mark.parametrize(
    "rule",
    [
        "FREQ=SECONDLY",
        "FREQ=MINUTELY;INTERVAL=60",
        "FREQ=HOURLY",  # 500k hours since 1970
        "FREQ=DAILY;BYHOUR=0,1,2,3,4,5,6,7,8,9,10,11;BYMINUTE=0,5,10,15,20,25,30,35,40,45,50,55",  # 144 a day
        "FREQ=YEARLY;BYMONTH=1,2,3,4,5,6,7,8,9,10,11,12;BYHOUR=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20",
    ],
)
def test_costly_rules_are_ignored_and_the_real_meeting_still_opens_a_window(tmp_path, rule: str) -> None:
    """The bomb sits next to a real weekly meeting: the meeting keeps its window, the bomb is shown in status."""
    path = tmp_path / "work.ics"
    path.write_text(_calendar(WEEKLY, _event("bomb", rule)), newline="")

    def status() -> dict:
        sched = IdleScheduler(str(tmp_path), sleep_start=None, sleep_end=None, timezone="Europe/Berlin",
                              idle_threshold_minutes=None, calendar=str(path), clock=lambda: NOW)  # fmt: skip
        return sched.status()

    st = _in_thread(status)
    assert st["open"] and st["reasons"] == ["in meeting 'Weekly sync'"]
    assert "1 recurring event(s) ignored as unbounded: 'bomb'" in st["sources"][0]


def test_bounded_rules_are_kept(tmp_path) -> None:
    """Everyday calendars stay whole: a daily stand-up since 1990, an hourly reminder since last week, a counted one."""
    path = tmp_path / "ok.ics"
    path.write_text(_calendar(_event("standup", "FREQ=DAILY", "19900101T080000Z"),
                              _event("hourly", "FREQ=HOURLY;INTERVAL=3", "20261116T000000Z"),
                              _event("yearly", "FREQ=YEARLY;BYMONTH=11;BYMONTHDAY=23", "19700101T130000Z"),
                              WEEKLY), newline="")  # fmt: skip
    cal = _in_thread(lambda: CalendarWindows(str(path), BERLIN, clock_now=NOW))
    assert cal.ignored == []
    reasons = " ".join(i.reason for i in cal.intervals(NOW))
    assert all(name in reasons for name in ("standup", "hourly", "yearly", "Weekly sync"))


class _Endless(http.server.BaseHTTPRequestHandler):
    """A calendar URL that never ends (no Content-Length, chunk after chunk); counts what it managed to send."""

    sent = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/calendar")
        self.end_headers()
        chunk = b"X-PAD:" + b"x" * 65536 + b"\r\n"
        try:
            while True:
                self.wfile.write(chunk)
                type(self).sent += len(chunk)
        except OSError:
            return

    def log_message(self, *args: object) -> None:
        pass


def test_an_endless_calendar_url_is_cut_off_at_max_bytes() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cal.ics"
        with pytest.raises(CalendarError, match="over 1048576 bytes"):
            _in_thread(lambda: CalendarWindows(url, UTC, max_bytes=1 << 20, timeout_s=10, clock_now=NOW))
    finally:
        server.shutdown()
        server.server_close()
    assert _Endless.sent < 64 << 20  # the reader stopped: what the server got out is the limit plus socket buffers


def _zone(rule: str, tzid: str = "Bomb/Zone") -> str:
    return (f"BEGIN:VTIMEZONE\r\nTZID:{tzid}\r\nBEGIN:STANDARD\r\nDTSTART:20260101T000000\r\nTZOFFSETFROM:+0100\r\n"
            f"TZOFFSETTO:+0100\r\nRRULE:{rule}\r\nEND:STANDARD\r\nEND:VTIMEZONE\r\n")  # fmt: skip


@pytest.mark.parametrize(
    "bomb",
    [
        _zone("FREQ=SECONDLY"),  # issue 43, finding 5: parsed (and expanded) before any event bound looked at it
        _zone("FREQ=YEARLY;BYMONTH=1,2,3,4,5,6,7,8,9,10,11,12;BYMONTHDAY=1,2,3,4,5,6,7,8,9,10;BYHOUR=1,2,3,4,5,6"),
        _zone("FREQ=DAILY;COUNT=100000000"),
        _event("exrule", "FREQ=DAILY").replace("RRULE:FREQ=DAILY", "RRULE:FREQ=DAILY\r\nEXRULE:FREQ=SECONDLY"),
        _event("alarm", "FREQ=WEEKLY").replace(
            "END:VEVENT",
            "BEGIN:VALARM\r\nTRIGGER:-PT5M\r\nACTION:DISPLAY\r\nRRULE:FREQ=SECONDLY\r\nEND:VALARM\r\nEND:VEVENT",
        ),
    ],
    ids=["vtimezone_secondly", "vtimezone_many_per_year", "vtimezone_daily", "exrule_secondly", "valarm_secondly"],
)
def test_a_recurrence_anywhere_in_the_calendar_is_bounded(tmp_path, bomb: str) -> None:
    """Issue 43, finding 5: `RRULE:FREQ=SECONDLY` inside a VTIMEZONE (503 bytes in the issue) took the service down;
    a recurrence is bounded wherever it appears (time zones, EXRULE, alarms), and the real meeting keeps its window."""
    path = tmp_path / "zone.ics"
    event = _event("tz-meeting", "FREQ=WEEKLY", "20261005T140000").replace("DTSTART:", "DTSTART;TZID=Bomb/Zone:")
    path.write_text(_calendar(bomb, event.replace("Z\r\n", "\r\n", 1) if "VTIMEZONE" in bomb else "", WEEKLY),
                    newline="")  # fmt: skip
    assert path.stat().st_size < 1200
    cal = _in_thread(lambda: CalendarWindows(str(path), BERLIN, clock_now=NOW), timeout=20.0)
    assert len(cal.ignored) == 1, cal.ignored
    assert any("Weekly sync" in i.reason for i in cal.intervals(NOW))


def test_real_time_zones_are_kept(tmp_path) -> None:
    """A VTIMEZONE as calendar programs write it (yearly DST rules) passes the screen and places the meeting."""
    zone = ("BEGIN:VTIMEZONE\r\nTZID:Custom/Berlin\r\nBEGIN:DAYLIGHT\r\nDTSTART:19700329T020000\r\nTZOFFSETFROM:+0100"
            "\r\nTZOFFSETTO:+0200\r\nRRULE:FREQ=YEARLY;BYMONTH=3;BYDAY=-1SU\r\nEND:DAYLIGHT\r\nBEGIN:STANDARD\r\n"
            "DTSTART:19701025T030000\r\nTZOFFSETFROM:+0200\r\nTZOFFSETTO:+0100\r\nRRULE:FREQ=YEARLY;BYMONTH=10;"
            "BYDAY=-1SU\r\nEND:STANDARD\r\nEND:VTIMEZONE\r\n")  # fmt: skip
    event = WEEKLY.replace("Europe/Berlin", "Custom/Berlin").replace("Weekly sync", "Custom sync")
    path = tmp_path / "ok.ics"
    path.write_text(_calendar(zone, event), newline="")
    cal = _in_thread(lambda: CalendarWindows(str(path), UTC, clock_now=NOW))
    assert cal.ignored == [] and any("Custom sync" in i.reason for i in cal.intervals(NOW))
