"""The end of training waits `final_timeout_s` for the last evaluation; one that is still running then is named in
the summary as not measured, and its late result is not recorded, so eval.jsonl and summary.json agree.

The evaluator here is held on an event (the ordering is the subject, not the scoring; the scoring against a real
server is in test_live_eval.py)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

from metaclaw.evaluation import LiveEvaluator
from metaclaw.evaluation.evaluator import EvalResult
from metaclaw.evaluation.report import write_report
from metaclaw.store import SampleStore


class HeldEvaluator:
    """Scores the base model at once and an adapter only when `release` is set."""

    def __init__(self) -> None:
        self.release, self.started = threading.Event(), threading.Event()

    def score(self, model: str) -> EvalResult:
        if model != "base":
            self.started.set()
            assert self.release.wait(30)
        return EvalResult(model, 0.25 if model == "base" else 0.75, n=4)


def test_an_evaluation_still_running_at_the_end_is_named_and_its_late_result_is_not_recorded(tmp_path):
    held = HeldEvaluator()
    live = LiveEvaluator(held, tmp_path, base_model="base", server_url="http://unused", final_timeout_s=0.2)
    live.gatekeeper.load_candidate = lambda path: None  # no server: the held evaluator never asks one
    live.start()
    try:
        assert live.wait(30)  # the base model's point
        live.submit(3, tmp_path / "step-000003", lambda path: None)
        assert held.started.wait(30)
        live.on_train_end(SimpleNamespace(loggers=[]), None)  # waits 0.2 s, then stops waiting
        assert live.unfinished == [{"agent_id": "default", "step": 3}]
        held.release.set()
        live.stop()
        live.worker.thread.join(30)
        assert not live.worker.thread.is_alive()
    finally:
        held.release.set()
        live.stop()
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] and [r["step"] for r in live.results] == [0]
    summary = write_report(tmp_path, live.results, SampleStore(tmp_path / "s.sqlite"), 3, 60.0,
                           unfinished=live.unfinished)  # fmt: skip
    assert summary["base_compliance"] == 0.25 and summary["final_compliance"] is None  # no adapter measured
    assert summary["unfinished_evaluations"] == live.unfinished
    assert "not measured: step 3 of agent default" in summary["text"]
    assert json.loads((tmp_path / "summary.json").read_text())["unfinished_evaluations"] == live.unfinished


def test_a_run_the_sample_stream_ended_early_says_so(tmp_path):
    """A simulated-user run whose agent stalled (no samples for `rollout.wait_timeout_s`) ends before its time
    budget; the summary says why, beside the figures it has."""
    results = [{"step": 0, "adapter": "base", "compliance": 0.25, "n": 4}]
    why = "no new sample for 120s (rollout.wait_timeout_s); 3 ready, fewer than the 4 a step needs"
    summary = write_report(tmp_path, results, SampleStore(tmp_path / "s.sqlite"), 2, 60.0, ended_early=why)
    assert summary["ended_early"] == why and f"the run ended early, at step 2: {why}" in summary["text"]
    assert json.loads((tmp_path / "summary.json").read_text())["ended_early"] == why
    assert write_report(tmp_path, results, SampleStore(tmp_path / "s.sqlite"), 2, 60.0)["ended_early"] is None


def test_an_end_that_waited_long_enough_leaves_nothing_unfinished(tmp_path):
    held = HeldEvaluator()
    held.release.set()
    live = LiveEvaluator(held, tmp_path, base_model="base", server_url="http://unused", final_timeout_s=30)
    live.gatekeeper.load_candidate = lambda path: None
    live.start(baseline=False)
    try:
        live.submit(1, tmp_path / "step-000001", lambda path: None)
        live.on_train_end(SimpleNamespace(loggers=[]), None)
    finally:
        live.stop()
    assert live.unfinished == [] and [r["step"] for r in live.results] == [1]
