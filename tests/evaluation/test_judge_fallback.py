"""Live evaluation without a verifier: held-out sessions judged by the rule judge, on the tiny model."""

from __future__ import annotations

import json
import sqlite3

from metaclaw.scoring.worker import is_heldout
from tests.entrypoints.test_train import run_cli


def test_is_heldout_is_a_stable_share_of_sessions():
    ids = [f"session-{i}" for i in range(2000)]
    held = [s for s in ids if is_heldout(s, 0.25)]
    assert 0.2 < len(held) / len(ids) < 0.3
    assert held == [s for s in ids if is_heldout(s, 0.25)]  # the same sessions every time
    assert not any(is_heldout(s, 0.0) for s in ids)


def test_replay_run_reports_the_judges_verdicts_on_heldout_turns_never_trained(tmp_path):
    out = run_cli(
        "model=tiny",
        "rollout=replay",
        "judge=rule",
        "trainer.max_steps=3",
        "eval.judge_fallback.heldout_share=0.5",
        "eval.judge_fallback.min_turns=1",
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
