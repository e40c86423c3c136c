"""Issue 42: the trainer's lag is measured and shown. In the main job the trainer ran up to 24 versions ahead of the
served adapter while `train/version_lag` read 0. The lag is shown in `status` and bounded by the loss's ratio cap;
samples are never dropped for it (counted against the trainer, every new sample of the main job was stale and its
stream ended after 10 steps)."""

from __future__ import annotations

from types import SimpleNamespace

from metaclaw.control.cli import format_status
from metaclaw.control.plane import trainer_lag
from metaclaw.datamodules.rollout import RolloutDataModule
from metaclaw.store.claims import ServedVersions


def test_a_trainer_ahead_of_the_served_adapter_never_makes_fresh_samples_stale(tmp_path):
    dm = RolloutDataModule(str(tmp_path / "s.sqlite"), max_staleness=4, served=ServedVersions(default=2))
    assert dm._min_adapter_version() == 2 - 4
    dm.trainer = SimpleNamespace(global_step=24)  # the trainer is 22 versions ahead of what is served
    assert dm.trainer_version() == 24 and dm._min_adapter_version() == 2 - 4  # what the user is served counts
    dm.served.update(30)
    assert dm._min_adapter_version() == 30 - 4


def test_status_shows_the_trainer_lag():
    assert trainer_lag(24, {"version": 2}) == 22 and trainer_lag(3, {"version": None}) == 3
    assert trainer_lag(None, {"version": 2}) is None
    text = format_status({"steps_done": 24, "trainer_lag": 22, "served_adapter": {"version": 2}})
    assert "trainer lag:   22 versions ahead of the served adapter" in text
