"""One real training server (tiny model) for the whole package, started by `scripts/start_training_server.sh`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-secret-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """Where the server listens, its checkpoint root and an authenticated client."""

    url: str
    checkpoint_dir: Path
    client: httpx.Client
    log: Path

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        """POST `body` as JSON; NaN/Infinity are written as Python's json does (httpx refuses them)."""
        content = json.dumps(body).encode()
        return self.client.post(path, content=content, headers={"content-type": "application/json"})

    def ok(self, path: str, body: dict) -> dict:
        r = self.post(path, body)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("training_server")
    port = _free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHON": sys.executable,
        "METACLAW_INFERENCE_BACKEND": "hf",
    }
    env.pop("METACLAW_TRAINING_DEVICES", None)
    cmd = [
        "bash",
        str(REPO / "scripts" / "start_training_server.sh"),
        "--port", str(port),
        "--api-key", API_KEY,
        "--checkpoint-dir", str(root / "ckpt"),
        "--log-level", "WARNING",
        "--model", "tiny",
        "devices=cpu",
        f"hydra.run.dir={root / 'hydra'}",
    ]  # fmt: skip
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
            yield Server(url=url, checkpoint_dir=root / "ckpt", client=client, log=log)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server's whole process group (it was started in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


@pytest.fixture(scope="package")
def session_id(server: Server) -> str:
    """One session shared by the tests that only need a session to exist."""
    return server.ok("/v1/lora/create", {"base_model": "tiny", "rank": 4})["session_id"]
