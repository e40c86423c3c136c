"""The gate's queue and the adapters it needs on disk, in the live service's shape (`rollout=proxy`: the judge
fallback, every `eval.every_n_adapters`-th candidate measured): a report-only pass never pushes a candidate out,
and `publish.keep_last` never deletes the served adapter or a candidate not measured yet."""

from __future__ import annotations

import json
from pathlib import Path

from metaclaw.evaluation import LiveEvaluator
from metaclaw.evaluation.regression import RegressionWatch
from metaclaw.modules.adapter_writer import AdapterWriter


class HeldoutTurns:
    """The judge fallback's evaluator as the queue sees it (nothing is measured: the worker is not started)."""

    by_version = True


def test_off_cadence_publishes_never_push_the_measured_candidate_out_of_the_queue(tmp_path):
    """A slow evaluation (a CPU, a real model) while training publishes fast: candidates 1-3 are held and queue a
    report of the replaced versions, 4 is measured; 5-7 must not push 4 out (they did: the report markers took the
    queue's two places and every measured candidate was `skipped`, so the served adapter never changed)."""
    live = LiveEvaluator(HeldoutTurns(), tmp_path, "tiny", every_n_adapters=4, gate=True, max_pending=2)
    paths = {step: tmp_path / f"step-{step:06d}" for step in range(1, 13)}
    served = []
    for step in range(1, 8):
        live.submit(step, paths[step], served.append)
    assert live.in_use() == {paths[4]}  # measured next, kept on disk meanwhile
    live.submit(8, paths[8], served.append)
    assert live.in_use() == {paths[4], paths[8]}  # both candidates wait (the report pass gave way)
    for step in range(9, 13):
        live.submit(step, paths[step], served.append)
    assert live.in_use() == {paths[8], paths[12]}  # the oldest candidate gave way to a newer one: said so
    skipped = [json.loads(line) for line in (tmp_path / "gate.jsonl").read_text().splitlines()]
    assert [(r["step"], r["decision"]) for r in skipped] == [(4, "skipped")]
    assert live.counts["gate_held"] == 9 and live.counts["skipped"] == 1 and served == []  # nothing unmeasured


def test_retention_keeps_the_served_adapter_and_the_candidates_not_measured_yet(tmp_path):
    """With the gate on, the served adapter can be older than the newest `keep_last`: pruning it broke a restart's
    reload and the rollback to it; pruning a candidate under measurement failed its hot-load once accepted."""
    writer = AdapterWriter(tmp_path, keep_last=2)
    for step in range(1, 8):
        (writer.adapters / f"step-{step:06d}").mkdir(parents=True)
    writer.write_latest(2, writer.adapters / "step-000002", "policy", None)
    writer.prune(keep=[writer.adapters / "step-000004"])
    left = sorted(p.name for p in writer.adapters.glob("step-*"))
    assert left == ["step-000002", "step-000004", "step-000006", "step-000007"]
    assert Path(writer.read_latest()["path"]).exists()


def test_retention_keeps_the_regression_watchs_rollback_target(tmp_path):
    """The adapter served before the one served now is where an automatic rollback goes: kept on disk."""
    live = LiveEvaluator(HeldoutTurns(), tmp_path, "tiny", gate=True)
    live.watch = RegressionWatch(store=None, rollback=lambda step, agent: {})
    live.watch.paths["policy"] = {v: str(tmp_path / f"step-{v:06d}") for v in (3, 5, 9)}
    assert live.in_use() == {tmp_path / "step-000005", tmp_path / "step-000009"}
