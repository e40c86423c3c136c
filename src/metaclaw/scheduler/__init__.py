"""The idle-time scheduler (seed 003, MadMax): train only while the user is away (sleep, idle, meetings)."""

from metaclaw.scheduler.calendar import CalendarError, CalendarWindows
from metaclaw.scheduler.callback import IdleScheduler, Window
from metaclaw.scheduler.idle import ActivityTracker, detect_host_idle
from metaclaw.scheduler.sources import IdleWindow, Interval, SleepHours
from metaclaw.scheduler.state import SchedulerState

__all__ = [
    "ActivityTracker",
    "CalendarError",
    "CalendarWindows",
    "IdleScheduler",
    "IdleWindow",
    "Interval",
    "SchedulerState",
    "SleepHours",
    "Window",
    "detect_host_idle",
]
