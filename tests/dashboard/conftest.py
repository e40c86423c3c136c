"""A finished run's directory with every figure the dashboard shows, and its read-only dashboard server."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from metaclaw.store import Sample, SampleStore, SampleText
from tests.dashboard.cdp import Browser, find_chromium
from tests.procs import REPO, stop_group


def make_run(run_dir: Path) -> Path:
    """eval.jsonl (one record with its own interval, the others without), gate.jsonl, adapters, a store."""
    now = time.time()
    evals = [
        {"step": 0, "adapter": "base", "agent_id": "default", "compliance": 0.25, "n": 32, "good": 0.2, "nll": 2.5,
         "fluent": 0.9, "time": now - 300},
        {"step": 4, "adapter": "step-000004", "agent_id": "default", "compliance": 0.5, "n": 32, "good": 0.45,
         "nll": 2.6, "fluent": 0.9, "time": now - 200, "gate": {"decision": "accepted"}},
        {"step": 8, "adapter": "step-000008", "agent_id": "default", "compliance": 0.75, "n": 32, "ci_low": 0.6,
         "ci_high": 0.88, "good": 0.7, "nll": 2.7, "fluent": 0.88, "time": now - 100},
    ]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    gate = [
        {"time": now - 200, "kind": "gate", "agent_id": "default", "step": 4, "adapter": "step-000004",
         "decision": "accepted", "served": 0.25, "candidate": 0.5, "candidate_ci": [0.33, 0.67], "n": 32},
        {"time": now - 150, "kind": "gate", "agent_id": "default", "step": 6, "adapter": "step-000006",
         "decision": "rejected", "served": 0.5, "candidate": 0.2, "candidate_ci": [0.1, 0.37], "n": 32,
         "reasons": ["compliance 0.20 < served 0.50 - margin 0.10"]},
        {"time": now - 120, "kind": "gate", "agent_id": "default", "step": 8, "adapter": "step-000008",
         "decision": "accepted", "finding": "inconclusive", "served": 0.5, "candidate": 0.3, "n": 32,
         "note": "served on inconclusive evidence; the regression watch rolls it back if verdicts drop"},
    ]  # fmt: skip
    (run_dir / "gate.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gate))
    for step in (4, 6, 8):
        d = run_dir / "adapters" / f"step-{step:06d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "adapter_config.json").write_text("{}")
    latest = {"version": 8, "path": str(run_dir / "adapters" / "step-000008")}
    (run_dir / "adapters" / "latest.json").write_text(json.dumps(latest))
    store = SampleStore(run_dir / "samples.sqlite")
    for i, (reward, status, meta) in enumerate([
        (1.0, "consumed", {"judge": {"rule": "positive"}}), (-1.0, "consumed", {"judge": {"rule": "negative"}}),
        (1.0, "dropped", {"dropped": "heldout", "judge": {"rule": "positive"}}),
        (None, "dropped", {"dropped": "no_next_state"}), (None, "ready", {}),
        (-1.0, "ready", {"feedback": {"score": -1.0}}),
    ]):  # fmt: skip
        store.insert(
            Sample(
                [1, 2],
                [3],
                [-1.0],
                session_id=f"s{i // 2}",
                turn_index=i % 2,
                reward=reward,
                status=status,
                meta=meta,
                text=SampleText(
                    messages=[{"role": "user", "content": "hello"}],
                    response_text="SECRET-REPLY-TEXT",
                    next_state="thanks",
                ),
            )
        )
    store.close()
    with sqlite3.connect(run_dir / "samples.sqlite") as db:  # the two trained samples: step 4's batch
        db.execute("UPDATE samples SET claimed_step=4 WHERE status='consumed'")
    (run_dir / "csv").mkdir()
    rows = [
        "step,loss/total,rollout/reward_mean,train/lr,train/grad_norm,train/samples_per_min,"
        "rollout/replies_per_min,train/sample_age_s,train/version_lag,loss/ratio_mean,loss/ratio_min,"
        "loss/ratio_max,loss/ratio_truncated_frac,epoch"
    ]
    rows += [
        f"{s},{0.5 - 0.05 * s},{0.1 * s},0.0003,{1.0 + s},{2.0},{3.0},{60 + s},{1},1.0,0.9,1.2,0.01,0"
        for s in range(1, 9)
    ]
    (run_dir / "csv" / "metrics.csv").write_text("\n".join(rows) + "\n")
    return run_dir


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Headless Chromium (Debian's `chromium`): skipped loudly outside CI when absent, failed in CI."""
    binary = find_chromium()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but chromium is not installed: .ci/run must apt-get install chromium")
        pytest.skip("!!! DASHBOARD BROWSER TEST SKIPPED: chromium is not installed (apt-get install -y chromium) !!!")
    b = Browser(binary)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def finished_run(tmp_path) -> Path:
    return make_run(tmp_path / "run")


@pytest.fixture
def read_only_dashboard(finished_run) -> Iterator[tuple[str, str, Path]]:
    """`(url, key, run_dir)` of `python -m metaclaw dashboard --run-dir DIR --key K` (a real server on 127.0.0.1)."""
    yield from dashboard_server(finished_run, "--key", DASHBOARD_KEY)


@pytest.fixture
def keyless_dashboard(finished_run) -> Iterator[tuple[str, str, Path]]:
    """`python -m metaclaw dashboard --run-dir DIR`: a finished run's page, no key (loopback only)."""
    yield from dashboard_server(finished_run)


DASHBOARD_KEY = "dashboard-test-key"


def dashboard_server(finished_run: Path, *args: str) -> Iterator[tuple[str, str, Path]]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "metaclaw", "dashboard", "--run-dir", str(finished_run), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        info = json.loads(proc.stdout.readline())
        base = info["url"].removesuffix("/dashboard")
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{base}/dashboard", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.2)
        yield base, info["key"], finished_run
    finally:
        stop_group(proc)
