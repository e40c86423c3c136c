"""Fixtures: a real `serve.py model=tiny` subprocess (own process group, killed at the end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from metaclaw.rollout.server import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def running_policy_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`(url, run_dir)`: serve.py on a free port, adapters confined to `<run_dir>/adapters`."""
    run_dir = tmp_path / "run"
    (run_dir / "adapters").mkdir(parents=True)
    port = free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "serve.py",
            "model=tiny",
            f"serve.port={port}",
            f"serve.adapter_root={run_dir / 'adapters'}",
            f"hydra.run.dir={tmp_path / 'server'}",
        ],
        cwd=REPO,
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve.py did not become healthy"
            time.sleep(0.3)
        yield url, run_dir
    finally:
        stop_group(proc)
        log.close()


@pytest.fixture
def policy_server(tmp_path) -> Iterator[tuple[str, Path]]:
    """`(url, run_dir)`: serve.py on a free port, adapters confined to `<run_dir>/adapters`."""
    with running_policy_server(tmp_path) as server:
        yield server
