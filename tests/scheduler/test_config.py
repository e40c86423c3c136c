"""`mode=auto` builds the scheduler from the `scheduler` config group; every option composes and instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from metaclaw.config import CONFIG_DIR
from metaclaw.scheduler import CalendarError, IdleScheduler

CONF = CONFIG_DIR


def compose_train(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["model=tiny", f"run_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "scheduler").glob("*.yaml")))
def test_mode_auto_instantiates_each_scheduler(tmp_path, option):
    cfg = compose_train(tmp_path, "mode=auto", f"scheduler={option}", "scheduler.idle_source=proxy")
    scheduler = instantiate(cfg.mode.scheduler)
    assert isinstance(scheduler, IdleScheduler) and scheduler.state_path.parent == tmp_path
    if option == "always_open":
        assert scheduler.refresh().open


def test_mode_rl_has_no_scheduler(tmp_path):
    assert compose_train(tmp_path).mode.scheduler is None


def test_a_malformed_calendar_stops_the_service_at_start(tmp_path):
    bad = tmp_path / "cal.ics"
    bad.write_text("BEGIN:VCALENDAR\nthis is not iCalendar\n")
    cfg = compose_train(tmp_path, "mode=auto", f"scheduler.calendar={bad}", "scheduler.idle_source=proxy")
    with pytest.raises(InstantiationException, match="not a valid iCalendar file") as err:
        instantiate(cfg.mode.scheduler)
    assert isinstance(err.value.__cause__, CalendarError) and f"scheduler.calendar {bad}" in str(err.value)
