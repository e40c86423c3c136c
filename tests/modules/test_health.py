"""Loop health in the logger and the progress bar: captures, judge failures, drops by reason, skipped steps."""

from __future__ import annotations

import asyncio

from metaclaw.modules.health import HealthMonitor
from metaclaw.scoring.worker import ScoringWorker
from metaclaw.store import Sample, SampleStore, SampleText, SessionLog


class DownJudge:
    async def reward(self, sample):
        raise ConnectionError("judge down")

    async def hint(self, sample):
        raise ConnectionError("judge down")


def test_a_judge_outage_shows_in_the_counters(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    for i in range(3):
        store.insert(
            Sample(
                [1, 2], [3], [-1.0], session_id="s", turn_index=i, text=SampleText(next_state="ok" if i < 2 else None)
            )
        )
    store.insert(Sample([1, 2], [3], [-1.0], session_id="t"))  # another session, still open
    SessionLog(store.path).touch("default", "s", done=True)
    worker = ScoringWorker(
        store, DownJudge(), needs_reward=True, max_attempts=1, session_idle_s=1e9, no_next_state="score"
    )  # every turn goes to the judge
    asyncio.run(worker.run_once())
    monitor = HealthMonitor(str(store.path))
    monitor.attach(worker=worker)
    snap = monitor.snapshot()
    assert snap["rollout/judge_failures"] == 3 and snap["rollout/dropped_judge_failed"] == 3
    assert snap["rollout/dropped"] == 3 and snap["rollout/backlog"] == 1 and snap["rollout/pending"] == 1
    assert "rollout/captured" not in snap  # no proxy attached: not reported as 0


def test_counters_reach_the_logger_and_the_progress_bar(tmp_path, caplog):
    import csv
    import logging

    from metaclaw.training import train
    from tests.entrypoints.test_train import compose_train

    with caplog.at_level(logging.INFO, logger="metaclaw.modules.health"):
        metrics, objs = train(compose_train(tmp_path, "method=opd", "trainer.max_steps=1"))
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step ")]
    assert steps and " ratio " in steps[-1] and "[" in steps[-1]  # the behaviour gap is in the step line (issue 46)
    assert {"loss/ratio_mean", "loss/ratio_min", "loss/ratio_max"} <= set(metrics)
    assert metrics["rollout/dropped_no_hint"] > 0  # seed 002: OPD turns without a hint are dropped, and counted
    assert metrics["train/skipped_nonfinite"] == 0 and metrics["train/publish_failures"] == 0
    bar = objs["trainer"].progress_bar_metrics
    for name in (
        "rollout/backlog",
        "train/skipped_nonfinite",
        "train/skipped_zero_advantage",
        "train/publish_failures",
    ):
        assert name in bar, sorted(bar)
    header = next(csv.reader((tmp_path / "csv" / "metrics.csv").open()))
    assert {"rollout/dropped_no_hint", "rollout/backlog", "train/zero_advantage_frac"} <= set(header)
