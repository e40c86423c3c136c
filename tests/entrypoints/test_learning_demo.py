"""The main job (`python train.py`: simulated user + live evaluation + summary + plot), on the tiny model."""

from __future__ import annotations

import json
import sqlite3

from tests.entrypoints.test_train import run_cli


def test_main_job_prints_the_summary_and_writes_the_plot(tmp_path):
    """Also: evaluation runs on a server of its own (`devices.eval_server`, auto on a CPU with >= 2 cores; set
    here so a 1-core machine runs it too): every evaluation request lands there, none on the agent's server."""
    out = run_cli(
        "model=tiny",
        "rollout=simulated_user",
        "trainer.max_steps=2",
        "eval.n_prompts=4",
        "eval.every_n_adapters=1",
        "eval.max_share=null",  # every adapter, whatever it costs: the curve is the subject here
        "eval.baseline=first",
        f"eval.cache.dir={tmp_path / 'eval-cache'}",
        "rollout.simulated_user.anthropic_share=0.5",
        "devices.eval_server=true",
        f"hydra.run.dir={tmp_path}",
        timeout=600,
        env={"METACLAW_PROFILE_DIR": str(tmp_path / "profile"), "METACLAW_PROFILE_EVERY_S": "0.5"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "=== metaclaw: what the agent learned ===" in out.stdout
    workers = [json.loads(f.read_text())["phases"] for f in (tmp_path / "profile").glob("server-worker-*.json")]
    serving = [p for p in workers if "generate:serve" in p]
    evaluating = [p for p in workers if "generate:metaclaw-eval" in p]
    assert len(serving) == 1 and len(evaluating) == 1 and serving != evaluating  # two servers, one job each
    assert not any(name.endswith(":metaclaw-eval") for name in serving[0])  # the user's server: no evaluation
    assert "generate:serve" not in evaluating[0] and "score:metaclaw-eval" in evaluating[0]
    assert (tmp_path / "eval-server" / "serve_config.yaml").exists() and (tmp_path / "server" / "server.log").exists()
    assert "base model" in out.stdout and "adapter step-000002" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert rows[0]["adapter"] == "base" and {"step-000001", "step-000002"} <= {r["adapter"] for r in rows}
    assert all(r["n"] == 4 and 0.0 <= r["compliance"] <= 1.0 for r in rows)
    # quality beside compliance: the base model's NLL of every evaluated reply, and the good-reply share
    assert all(r["nll"] > 0 and 0.0 <= r["good"] <= r["compliance"] and 0.0 <= r["junk"] <= 1.0 for r in rows)
    assert all(r["nll_threshold"] == rows[0]["nll"] + 1.0 for r in rows)  # eval.quality.nll_margin: 1.0
    assert (tmp_path / "compliance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    user = summary["user"]
    with sqlite3.connect(tmp_path / "samples.sqlite") as db:
        consumed = db.execute("SELECT COUNT(*) FROM samples WHERE status = 'consumed'").fetchone()[0]
    # what the store holds as trained: 0 when both batches carried equal rewards (a random reply often passes the
    # tiny run's verifier): such a batch takes no gradient and goes back to the store (issue 42)
    assert summary["steps"] == 2 and summary["samples_trained"] == consumed == summary["store"]["consumed"]
    assert summary["ended_early"] is None and summary["unfinished_evaluations"] == []  # ended at max_steps
    assert user["replies"] > 0 and user["errors"] == 0
    assert 0 < user["anthropic_sessions"] < user["sessions"]  # both routes: /v1/messages and the openai client
    assert summary["base_compliance"] == rows[0]["compliance"]
    assert summary["base_nll"] == rows[0]["nll"] and summary["base_good"] == rows[0]["good"]
    assert "good" in out.stdout and "NLL" in out.stdout
    metrics = (tmp_path / "csv" / "metrics.csv").read_text()
    assert all(f"eval/{k}" in metrics for k in ("compliance", "nll", "good", "fluent", "junk", "distinct_2"))
