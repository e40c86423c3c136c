"""The main job with two simulated agents (`python train.py +agents.alice.mode=rl
+preference@rollout.simulated_user.agents.alice=opening`), on the tiny model: each agent's adapter is evaluated
and gated on its own, against its own user's preference."""

from __future__ import annotations

import json

import pytest

from metaclaw.runfiles.layout import RunLayout
from tests.entrypoints.test_train import run_cli


@pytest.mark.slow
def test_agent_main_job_evaluates_and_gates_each_agents_adapter(tmp_path):
    out = run_cli(
        "model=tiny",
        "rollout=simulated_user",
        "+agents.alice.mode=rl",
        "+preference@rollout.simulated_user.agents.alice=opening",
        "trainer.max_steps=6",
        "data.batch_size=2",
        "eval.n_prompts=2",
        "eval.every_n_adapters=1",
        "publish.gate.enabled=true",
        "publish.gate.max_nll_increase=null",
        f"hydra.run.dir={tmp_path}",
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    by_agent = {a: [r for r in rows if r["agent_id"] == a] for a in ("default", "alice")}
    assert {r["agent_id"] for r in rows} == {"default", "alice"}
    for agent, records in by_agent.items():
        assert records[0]["adapter"] == "base" and records[0]["step"] == 0, agent
        assert all(r["n"] == 2 and "gate" in r for r in records[1:]), agent  # each candidate went through its gate
    alice_steps = {version for version, _ in RunLayout(tmp_path).adapters("alice").versions()}
    assert {r["step"] for r in by_agent["alice"][1:]} <= alice_steps and len(by_agent["alice"]) > 1
    assert "Sure thing" not in json.dumps(by_agent["default"][0]["failures"])  # each agent: its own verifier
    assert set(by_agent["alice"][0]["failures"]) <= {"starts_with"}
    assert set(by_agent["default"][0]["failures"]) <= {"gives_number"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["agents"]) == {"default", "alice"} and summary["user"]["agents"]["alice"]["replies"] > 0
    assert " agent alice:" in out.stdout and " agent default:" in out.stdout
    metrics = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"eval/compliance", "agent/alice/eval/compliance", "agent/alice/eval/gate_accepted"} <= set(metrics)
