"""`train()` builds each part with what it depends on (constructor arguments), and reads top to bottom."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from metaclaw import training
from metaclaw.datamodules import RolloutDataModule
from metaclaw.modules.publisher import AdapterPublisher
from metaclaw.scheduler import IdleScheduler
from metaclaw.store import ServedVersions


def test_train_reads_top_to_bottom_in_under_60_lines():
    tree = ast.parse(Path(training.__file__).read_text())
    lengths = {f.name: f.end_lineno - f.lineno + 1 for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert lengths["train"] + lengths["_train"] <= 75 and lengths["_train"] < 60, lengths


def test_the_publisher_and_the_datamodule_share_the_served_versions(tmp_path):
    """Staleness counts against what the publisher learnt is served: one state object, given to both."""
    served = ServedVersions()
    datamodule = RolloutDataModule(str(tmp_path / "s.sqlite"), served=served)
    publisher = AdapterPublisher(str(tmp_path), str(tmp_path / "s.sqlite"), served=served)
    publisher.served.update(7, {"default": 7, "alice": 3})
    assert datamodule.adapter_version == 7 and datamodule.adapter_versions == {"default": 7, "alice": 3}


def test_constructors_show_what_each_part_depends_on(tmp_path):
    """What `train()` used to set after construction is a constructor argument now."""
    assert {"served", "should_stop", "gate", "partition", "window_open", "always_adapters"} <= set(
        inspect.signature(RolloutDataModule).parameters
    )
    assert {"served", "release", "agents"} <= set(inspect.signature(AdapterPublisher).parameters)
    assert "gate" not in inspect.signature(AdapterPublisher).parameters  # publish.gate is the release's
    stop_requested = []
    scheduler = IdleScheduler(str(tmp_path), sleep_start=None, sleep_end=None, idle_threshold_minutes=None,
                              should_stop=lambda: bool(stop_requested), ungated={"alice"})  # fmt: skip
    assert scheduler.ungated == {"alice"} and not scheduler.should_stop()
    stop_requested.append(True)
    assert scheduler.should_stop()
