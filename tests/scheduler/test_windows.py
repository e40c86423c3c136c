"""Windows open and close at the right times: sleep hours (across midnight, DST), idle, pause, train-now,
min_window_minutes, and the state surviving a restart."""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from metaclaw.scheduler import ActivityTracker, IdleScheduler, SleepHours, detect_host_idle
from metaclaw.scheduler.callback import STATE_FILE
from tests.scheduler.fakes import FakeClock, FakeIdle

BERLIN = ZoneInfo("Europe/Berlin")


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=BERLIN)


def scheduler(tmp_path, clock, idle=None, **kw) -> IdleScheduler:
    settings = dict(sleep_start="23:00", sleep_end="07:00", timezone="Europe/Berlin", idle_threshold_minutes=30,
                    min_window_minutes=15, poll_s=0.05)  # fmt: skip
    settings.update(kw)
    return IdleScheduler(str(tmp_path), idle_source=idle or FakeIdle(clock), clock=clock, **settings)


@pytest.mark.parametrize(
    ("when", "is_open"),
    [
        (at(2026, 11, 22, 22, 59), False),
        (at(2026, 11, 22, 23, 0), True),
        (at(2026, 11, 23, 0, 30), True),  # across midnight
        (at(2026, 11, 23, 6, 59), True),
        (at(2026, 11, 23, 7, 0), False),
        (at(2026, 11, 23, 12, 0), False),
    ],
)
def test_sleep_hours_across_midnight(when, is_open):
    sleep = SleepHours("23:00", "07:00", BERLIN)
    assert (sleep.current(when.astimezone(timezone.utc)) is not None) is is_open


def test_sleep_hours_follow_the_time_zone_through_dst():
    sleep = SleepHours("23:00", "07:00", BERLIN)
    autumn = sleep.current(at(2026, 10, 25, 1, 0).astimezone(timezone.utc))  # clocks go back at 03:00
    assert autumn.start == datetime(2026, 10, 24, 21, 0, tzinfo=timezone.utc)  # 23:00 CEST
    assert autumn.end == datetime(2026, 10, 25, 6, 0, tzinfo=timezone.utc)  # 07:00 CET
    assert autumn.minutes == 9 * 60
    spring = sleep.current(at(2026, 3, 29, 1, 0).astimezone(timezone.utc))  # clocks go forward at 02:00
    assert spring.minutes == 7 * 60
    # the same wall-clock window in another zone is another instant
    tokyo = SleepHours("23:00", "07:00", ZoneInfo("Asia/Tokyo"))
    assert tokyo.current(at(2026, 11, 22, 16, 0)) is not None and sleep.current(at(2026, 11, 22, 16, 0)) is None


def test_daytime_sleep_window_and_bad_settings():
    nap = SleepHours("13:00", "14:00", BERLIN)
    assert nap.current(at(2026, 11, 22, 13, 30)) and not nap.current(at(2026, 11, 22, 14, 0))
    with pytest.raises(ValueError, match="sleep_start"):
        SleepHours("25:00", "07:00", BERLIN)
    with pytest.raises(ValueError, match="both"):
        SleepHours("07:00", "07:00", BERLIN)
    with pytest.raises(ValueError, match="timezone"):
        IdleScheduler("/tmp", timezone="Mars/Olympus", idle_source="proxy")
    with pytest.raises(ValueError, match="on_user_return"):
        IdleScheduler("/tmp", on_user_return="later", idle_source="proxy")


def test_idle_threshold_opens_and_a_returning_user_closes(tmp_path):
    clock = FakeClock(at(2026, 11, 23, 10, 0))
    idle = FakeIdle(clock)
    s = scheduler(tmp_path, clock, idle)
    clock.advance(minutes=60)  # no proxy request for an hour: the host source decides
    idle.away(29)
    w = s.refresh()
    assert not w.open and "user active: idle 29 min < 30 min (fake+proxy)" in w.reasons
    nxt = s.next_window()
    assert nxt.start == clock() + timedelta(minutes=1) and "idle" in nxt.reason
    idle.away(31)
    w = s.refresh()
    assert w.open and w.reasons == ["user idle 31 min (fake+proxy)"]
    idle.back()
    assert not s.refresh().open


def test_proxy_requests_count_as_activity(tmp_path):
    clock = FakeClock(at(2026, 11, 23, 10, 0))
    idle = FakeIdle(clock)
    idle.away(120)
    s = scheduler(tmp_path, clock, idle)
    assert not s.refresh().open  # the scheduler just started: the proxy has not been idle 30 min yet
    clock.advance(minutes=31)
    assert s.refresh().open
    s.activity.touch()  # the agent sent a request
    assert not s.refresh().open


def test_pause_resume_and_train_now(tmp_path):
    clock = FakeClock(at(2026, 11, 23, 23, 30))  # inside sleep hours
    idle = FakeIdle(clock)
    s = scheduler(tmp_path, clock, idle)
    assert s.refresh().open
    s.pause()
    assert not s.refresh().open and "paused" in s.refresh().reasons[0]
    s.resume()
    assert s.refresh().open
    clock.set(at(2026, 11, 24, 12, 0))
    idle.back()
    assert not s.refresh().open
    s.train_now(minutes=20)
    assert s.refresh().open and "train-now" in s.refresh().reasons[0]
    clock.advance(minutes=21)
    assert not s.refresh().open


def test_min_window_minutes_keeps_short_windows_closed(tmp_path):
    clock = FakeClock(at(2026, 11, 23, 13, 5))
    short = scheduler(tmp_path / "a", clock, sleep_start="13:00", sleep_end="13:10", idle_threshold_minutes=None)
    w = short.refresh()
    assert not w.open and "shorter than min_window_minutes=15" in w.reasons[0]
    assert short.next_window() is None or short.next_window().minutes >= 15
    long = scheduler(tmp_path / "b", clock, sleep_start="13:00", sleep_end="13:20", idle_threshold_minutes=None)
    assert long.refresh().open


def test_next_window_is_the_next_sleep_start(tmp_path):
    clock = FakeClock(at(2026, 11, 23, 12, 0))
    s = scheduler(tmp_path, clock, idle_threshold_minutes=None)
    nxt = s.next_window()
    assert nxt.start == at(2026, 11, 23, 23, 0) and nxt.end == at(2026, 11, 24, 7, 0)
    assert s.status()["next_window"]["start"] == nxt.start.isoformat()


def test_restart_keeps_pause_train_now_and_window(tmp_path):
    clock = FakeClock(at(2026, 11, 23, 12, 0))
    s = scheduler(tmp_path, clock)
    s.pause()
    assert (tmp_path / STATE_FILE).exists()
    again = scheduler(tmp_path, clock)
    assert again.state.paused and not again.refresh().open
    again.train_now(minutes=60)
    since = again.state.window_since
    third = scheduler(tmp_path, clock)
    assert not third.state.paused and third.refresh().open and third.state.window_since == since
    clock.advance(minutes=61)
    assert not scheduler(tmp_path, clock).refresh().open


def test_corrupt_state_is_set_aside_loudly(tmp_path, caplog):
    (tmp_path / STATE_FILE).write_text("{not json")
    clock = FakeClock(at(2026, 11, 23, 12, 0))
    s = scheduler(tmp_path, clock)
    assert not s.state.paused and (tmp_path / "scheduler_state.corrupt").exists()
    assert "unreadable" in caplog.text


def test_without_sources_the_window_is_always_open_but_pausable(tmp_path):
    clock = FakeClock(at(2026, 11, 23, 12, 0))
    s = IdleScheduler(str(tmp_path), sleep_start=None, sleep_end=None, idle_threshold_minutes=None, clock=clock)
    assert s.refresh().open
    s.pause()
    assert not s.refresh().open


def test_idle_source_detection():
    assert detect_host_idle("proxy") is None
    with pytest.raises(ValueError, match="idle_source"):
        detect_host_idle("telepathy")
    with pytest.raises(ValueError, match="windows"):
        detect_host_idle("windows")  # not this host
    detect_host_idle("auto")  # whatever works here (or None): never raises
    tracker = ActivityTracker()
    tracker.touch()
    assert tracker.idle_seconds(datetime.now(timezone.utc)) < 5


def test_wait_blocks_until_open_and_stops_on_request(tmp_path):
    import threading

    clock = FakeClock(at(2026, 11, 23, 12, 0))
    idle = FakeIdle(clock)
    s = scheduler(tmp_path, clock, idle)
    results = []
    t = threading.Thread(target=lambda: results.append(s.wait_until_open()))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # closed: waiting
    idle.away(45)
    clock.advance(minutes=45)  # the proxy too
    t.join(5)
    assert results == [True]
    idle.back()
    t = threading.Thread(target=lambda: results.append(s.wait_until_open()))
    t.start()
    t.join(0.3)
    s.stop()
    t.join(5)
    assert results == [True, False]


def test_logind_idle_hint_through_loginctl(tmp_path, monkeypatch):
    """A stand-in `loginctl` on PATH: IdleHint=yes since 10 minutes ago → 600 s; IdleHint=no → 0."""
    from metaclaw.scheduler.idle import LogindIdle

    now = datetime.now(timezone.utc)
    since_us = int((now.timestamp() - 600) * 1e6)
    hint = tmp_path / "hint"
    hint.write_text(f"IdleHint=yes\nIdleSinceHint={since_us}\n")
    fake = tmp_path / "loginctl"
    fake.write_text(f'#!/bin/sh\n[ "$1 $2" = "show-session 7" ] || exit 1\ncat {hint}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_SESSION_ID", "7")
    source = detect_host_idle("logind")
    assert isinstance(source, LogindIdle) and abs(source.idle_seconds(now) - 600) < 1
    hint.write_text("IdleHint=no\nIdleSinceHint=0\n")
    assert source.idle_seconds(now) == 0.0
    monkeypatch.setenv("XDG_SESSION_ID", "8")  # loginctl fails for this session
    with pytest.raises(ValueError, match="logind does not work"):
        detect_host_idle("logind")
