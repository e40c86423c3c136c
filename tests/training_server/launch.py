"""Start a real training server (tiny model, `scripts/start_training_server.sh`) on a free port, with overrides."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.procs import free_port, serving

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-secret-key"


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

    def create(self, rank: int = 4) -> str:
        return self.ok("/v1/lora/create", {"base_model": "tiny", "rank": rank})["session_id"]

    def sessions(self) -> list[str]:
        r = self.client.get("/v1/lora/sessions")
        assert r.status_code == 200, r.text
        return [x["session_id"] for x in r.json()["sessions"]]


@contextmanager
def training_server(root: Path, overrides: Sequence[str] = ()) -> Iterator[Server]:
    """A server on a free port with checkpoints under `root/ckpt`; stopped (process group) when the block ends."""
    port = free_port()
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
        *overrides,
    ]  # fmt: skip
    log = root / "server.log"
    url = f"http://127.0.0.1:{port}"
    with serving(cmd, f"{url}/v1/health", log, env=env, timeout_s=120) as proc:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
            yield Server(url=url, checkpoint_dir=root / "ckpt", client=client, log=log)
        assert proc.poll() is None, f"the training server died:\n{log.read_text()[-3000:]}"
