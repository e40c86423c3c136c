"""Fixtures: a real `serve.py model=tiny` subprocess (own process group, killed at the end)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.procs import free_port, serving

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}


@contextmanager
def running_policy_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`(url, run_dir)`: serve.py on a free port, adapters confined to `<run_dir>/adapters`."""
    run_dir = tmp_path / "run"
    (run_dir / "adapters").mkdir(parents=True)
    port = free_port()
    cmd = [sys.executable, "serve.py", "model=tiny", f"serve.port={port}",
           f"serve.adapter_root={run_dir / 'adapters'}", f"hydra.run.dir={tmp_path / 'server'}"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serving(cmd, f"{url}/health", tmp_path / "server.log"):
        yield url, run_dir


@pytest.fixture
def policy_server(tmp_path) -> Iterator[tuple[str, Path]]:
    """`(url, run_dir)`: serve.py on a free port, adapters confined to `<run_dir>/adapters`."""
    with running_policy_server(tmp_path) as server:
        yield server
