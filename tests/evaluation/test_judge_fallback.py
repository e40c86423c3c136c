"""Live evaluation without a verifier: held-out sessions judged by the rule judge, on the tiny model."""

from __future__ import annotations

import json
import sqlite3

import pytest

from metaclaw.scoring.worker import is_heldout
from tests.e2e.lifecycle import ONE_SERVER
from tests.entrypoints.test_train import run_cli


def test_is_heldout_is_a_stable_share_of_sessions():
    ids = [f"session-{i}" for i in range(2000)]
    held = [s for s in ids if is_heldout(s, 0.25)]
    assert 0.2 < len(held) / len(ids) < 0.3
    assert held == [s for s in ids if is_heldout(s, 0.25)]  # the same sessions every time
    assert not any(is_heldout(s, 0.0) for s in ids)


@pytest.mark.slow  # a whole train.py replay run (~30 s): `make test-slow`; its gate rules stay fast (test_gate_rule.py)
def test_replay_run_reports_the_judges_verdicts_on_heldout_turns_never_trained(tmp_path):
    out = run_cli(
        "model=tiny",
        "rollout=replay",
        "judge=rule",
        "trainer.max_steps=3",
        "eval.judge_fallback.heldout_share=0.5",
        "eval.judge_fallback.min_turns=1",
        ONE_SERVER,
        f"hydra.run.dir={tmp_path}",
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert rows and rows[0]["adapter"] == "base" and rows[0]["step"] == 0  # the base model's held-out turns
    for r in rows:
        assert r["n"] >= 1 and -1.0 <= r["reward"] <= 1.0 and 0.0 <= r["compliance"] <= 1.0
        assert r["nll"] > 0 and set(r["failures"]) == {"judge"}
    with sqlite3.connect(tmp_path / "samples.sqlite") as c:
        samples = c.execute("SELECT session_id, status, meta FROM samples").fetchall()
    held = [(sid, st) for sid, st, meta in samples if json.loads(meta).get("dropped") == "heldout"]
    assert held and all(st == "dropped" and is_heldout(sid, 0.5) for sid, st in held)
    consumed = [sid for sid, st, _ in samples if st == "consumed"]
    assert consumed and not any(is_heldout(sid, 0.5) for sid in consumed)  # never trained on
    assert "=== metaclaw: what the agent learned ===" in out.stdout
    metrics = (tmp_path / "csv" / "metrics.csv").read_text()
    assert "eval/reward" in metrics and "eval/nll" in metrics


def test_agent_heldout_turns_are_reported_per_agent_adapter(tmp_path):
    """`rollout=proxy` with `+agents.alice.mode=rl` and the judge fallback: the wiring gives each adapter its own
    evaluator, reading only the held-out turns of the agents it serves (carol: the default profile), at that
    adapter's own versions; records carry `agent_id`, metrics are `eval/*` and `agent/alice/eval/*`."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger

    from metaclaw.loop.eval_wiring import bind_evaluator, build_evaluator
    from metaclaw.store import Sample, SampleStore
    from tests.entrypoints.test_train import compose_train

    store = SampleStore(tmp_path / "samples.sqlite")
    turns = [("alice", 0, 1.0), ("alice", 0, -1.0), ("alice", 3, 1.0), ("default", 0, -1.0), ("carol", 0, -1.0),
             ("carol", 2, 1.0), ("default", 2, 1.0), ("bob", 0, 1.0)]  # fmt: skip
    for agent, version, reward in turns:
        store.insert(Sample([1, 2], [3, 4], [-1.0, -1.0], agent_id=agent, adapter_version=version, reward=reward,
                            status="dropped", meta={"dropped": "heldout"}))  # fmt: skip
    store.insert(Sample([1, 2], [3], [-1.0], agent_id="alice", adapter_version=3, reward=1.0, status="ready"))
    cfg = compose_train(tmp_path, "rollout=proxy", "judge=rule", "method=rl", "+agents.alice.mode=rl",
                        "+agents.bob.mode=skills_only", "eval.enabled=true", "eval.judge_fallback.heldout_share=0.5",
                        "eval.judge_fallback.min_turns=1", "eval.quality.enabled=false",
                        "publish.gate.enabled=false")  # fmt: skip  # reporting only: served at once
    live = build_evaluator(cfg)
    bind_evaluator(cfg, live, "http://127.0.0.1:9", None, store)  # no quality figures: the server is not asked
    try:
        assert set(live.tracks) == {"default", "alice"}  # bob (skills_only) has no adapter
        live.submit(3, tmp_path / "a3", lambda path: None, agent="alice")  # alice's v3 replaced her base
        assert live.wait(30)
        assert [(r["agent_id"], r["step"]) for r in live.results] == [("alice", 0)]
        logger = CSVLogger(tmp_path, name="csv", version="")
        live.on_train_end(SimpleNamespace(loggers=[logger]), None)  # the end of training: every version
    finally:
        live.stop()
    got = {(r["agent_id"], r["step"]): (r["n"], r["compliance"]) for r in live.results}
    assert got == {("alice", 0): (2, 0.5), ("alice", 3): (1, 1.0), ("default", 0): (2, 0.0), ("default", 2): (2, 1.0)}
    header = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"eval/compliance", "eval/reward", "agent/alice/eval/compliance", "agent/alice/eval/reward"} <= set(header)
