"""Shared fixtures: every test runs offline, on CPU, with the tiny random Qwen3."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_spec():
    from metaclaw.modules.loading import ModelSpec

    return ModelSpec(name="tiny", path="tiny", dtype="float32", max_seq_len=1024)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_spec):
    return tiny_spec.load_tokenizer()


@pytest.fixture
def tiny_policy(tiny_spec):
    from metaclaw.modules.policy import LoraPolicy

    return LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8)


@pytest.fixture(scope="session")
def tiny_policy_server(tmp_path_factory):
    """`serve.py model=tiny` with an API key (`.url`, `.key`), shared by the session's conformance and
    reliability tests; short replies by default (`serve.default_max_tokens=16`)."""
    import sys
    from types import SimpleNamespace

    from tests.procs import free_port, serving

    run_dir = tmp_path_factory.mktemp("tiny-policy-server")
    port, key = free_port(), "tiny-server-key"
    cmd = [sys.executable, "serve.py", "model=tiny", f"serve.port={port}", f"hydra.run.dir={run_dir}",
           f"serve.adapter_root={run_dir / 'adapters'}", "serve.default_max_tokens=16"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serving(cmd, f"{url}/health", run_dir / "server.log", env={"METACLAW_API_KEY": key}):
        yield SimpleNamespace(url=url, key=key, log=run_dir / "server.log")
