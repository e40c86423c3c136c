"""The real service: `train.py mode=auto rollout=proxy` (tiny model) waits outside a window while samples
accumulate, trains on `train-now`, rolls back, stops on SIGTERM while paused, and comes back paused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "service-test-key"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
       "METACLAW_PROXY_API_KEY": KEY, "PYTHONPATH": str(REPO / "src")}  # fmt: skip


def start(run_dir: Path, port: int, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "train.py", "model=tiny", "rollout=proxy", "mode=auto", f"rollout.proxy.port={port}",
           f"hydra.run.dir={run_dir}", "scheduler.sleep_start=null", "scheduler.sleep_end=null",
           "scheduler.idle_source=proxy", "scheduler.poll_s=0.5", "data.batch_size=2", "rollout.min_batch_size=1",
           "trainer.max_steps=50", "logger=csv", *overrides]  # fmt: skip
    log = open(run_dir.parent / f"train-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def ctl(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metaclaw", "--run-dir", str(run_dir), *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def status(run_dir: Path) -> dict:
    out = ctl(run_dir, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for(condition, timeout: float = 300.0, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
            if value:
                return value
        except (httpx.HTTPError, OSError, ValueError, AssertionError):
            pass
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM to train.py (it stops its policy server); the group is killed only if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


@pytest.mark.slow
def test_control_a_running_service(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(run_dir, port)
    try:
        wait_for(lambda: (run_dir / "control.json").exists() and httpx.get(f"{url}/health").status_code == 200)
        s = status(run_dir)
        assert s["window"]["open"] is False and s["steps_done"] == 0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)

        def sessions(first: int, n: int) -> None:
            for i in range(first, first + n):
                messages = [{"role": "user", "content": f"2+{i}?"}]
                headers = {"X-Session-Id": f"s{i}", "X-Session-Done": "true"}
                client.chat.completions.create(model="metaclaw", max_tokens=4, messages=messages, extra_headers=headers)

        sessions(0, 6)
        wait_for(lambda: status(run_dir)["samples_waiting"] >= 4)
        time.sleep(2)
        assert status(run_dir)["steps_done"] == 0  # closed: samples wait, nothing trains
        assert ctl(run_dir, "train-now", "--minutes", "30").returncode == 0
        wait_for(lambda: status(run_dir)["steps_done"] >= 2)
        out = ctl(run_dir, "rollback", "1")
        assert out.returncode == 0 and "serving step-000001" in out.stdout, out.stderr
        s = status(run_dir)
        assert s["served_adapter"]["path"].endswith("step-000001") and s["window"]["paused"] is True
        steps = s["steps_done"]
        sessions(6, 4)  # paused: they are captured and scored, and wait
        wait_for(lambda: status(run_dir)["samples_waiting"] >= 2)
        time.sleep(2)
        assert status(run_dir)["steps_done"] == steps
        assert stop(proc) == 0
        assert "sched/window_open" in (run_dir / "csv" / "metrics.csv").read_text()
        proc = start(run_dir, port)  # a restart keeps the pause
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200 and status(run_dir))
        s = status(run_dir)
        assert s["window"]["paused"] is True and s["rollback_step"] == 1
    finally:
        stop(proc)
