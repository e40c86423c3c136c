"""Issue 43 (finding 8): the policy server process inherited the owner's proxy key (and the judge's and evolver's);
it starts with its own key only."""

from __future__ import annotations

import subprocess
import sys

from metaclaw.loop.policy_server import server_env


def test_the_policy_server_gets_its_own_key_and_no_other(monkeypatch):
    monkeypatch.setenv("METACLAW_PROXY_API_KEY", "owner-secret")
    monkeypatch.setenv("METACLAW_JUDGE_API_KEY", "judge-secret")
    monkeypatch.setenv("METACLAW_API_KEY", "someone-elses")
    monkeypatch.setenv("METACLAW_LOG_LEVEL", "debug")  # not a key: kept
    env = server_env("per-run-key")
    seen = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.environ.items()))"], env=env,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "owner-secret" not in seen and "judge-secret" not in seen and "someone-elses" not in seen
    assert env["METACLAW_API_KEY"] == "per-run-key" and env["METACLAW_LOG_LEVEL"] == "debug"
    assert "METACLAW_API_KEY" not in server_env(None)
