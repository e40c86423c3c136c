"""The learning summary with several agents: a table, a summary entry and a plot panel per agent; the default
agent's figures stay at the top level."""

from __future__ import annotations

import json

from metaclaw.evaluation.report import write_report
from metaclaw.store import SampleStore


def _record(agent: str | None, step: int, compliance: float) -> dict:
    rec = {"step": step, "adapter": "base" if step == 0 else f"step-{step:06d}", "compliance": compliance, "n": 4,
           "good": compliance / 2, "nll": 2.0 + step / 10, "nll_threshold": 3.0, "junk": 0.0}  # fmt: skip
    return rec if agent is None else {**rec, "agent_id": agent}


def test_agent_summary_shows_each_agent_and_keeps_the_default_at_the_top(tmp_path):
    results = [_record("default", 0, 0.25), _record("alice", 0, 0.0), _record("alice", 3, 0.75),
               _record("default", 2, 0.5)]  # fmt: skip
    per_user = {"simulated-user": {"replies": 5, "complied": 2}, "alice": {"replies": 3, "complied": 1}}
    user = {"sessions": 4, "replies": 8, "complied": 3, "corrected": 5, "agents": per_user}
    summary = write_report(tmp_path, results, SampleStore(tmp_path / "s.sqlite"), 5, 60.0, user)
    assert (summary["base_compliance"], summary["final_compliance"]) == (0.25, 0.5)  # the default agent's
    alice = summary["agents"]["alice"]
    assert (alice["base_compliance"], alice["final_compliance"], alice["final_good"]) == (0.0, 0.75, 0.375)
    assert [p["step"] for p in alice["curve"]] == [0, 3] and list(summary["agents"]) == ["default", "alice"]
    text = summary["text"]
    assert " agent default:" in text and " agent alice:" in text and "adapter step-000003" in text
    assert text.index(" agent alice:") < text.index("adapter step-000003")
    assert "as alice: 3 replies, 1 thanked" in text
    assert (tmp_path / "compliance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["agents"]["alice"]["final_compliance"] == 0.75


def test_agent_free_records_give_the_single_agent_summary(tmp_path):
    summary = write_report(tmp_path, [_record(None, 0, 0.25), _record(None, 2, 0.5)],
                           SampleStore(tmp_path / "s.sqlite"), 2, 60.0)  # fmt: skip
    assert "agents" not in summary and " agent default:" not in summary["text"]
    assert (summary["base_compliance"], summary["final_compliance"]) == (0.25, 0.5)
