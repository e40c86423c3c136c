"""Fixtures for the skills tests: a temp skills root, a shared embedding ranker, a scripted LLM endpoint."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture
def root(tmp_path):
    """An empty skills root (the starter bank is seeded into `_shared/` on first use)."""
    return tmp_path / "skills"


@pytest.fixture(scope="session")
def embedding_ranker(tmp_path_factory):
    """One EmbeddingRanker per session (loading the model takes a few seconds)."""
    from metaclaw.skills import EmbeddingRanker

    return EmbeddingRanker(cache_dir=tmp_path_factory.mktemp("emb-cache"))


class ScriptedLLM:
    """An OpenAI-compatible `/chat/completions` endpoint on 127.0.0.1 that replies from a script.

    Each entry of `replies` is either a string (returned as the assistant message) or an int HTTP status. With
    `context_chars` set, a request whose messages hold more characters is refused as the policy server refuses
    one over its model's context (400 `context_length_exceeded`), without using a reply.
    """

    def __init__(self) -> None:
        self.replies: list[str | int] = []
        self.context_chars: int | None = None
        self.delay_s = 0.0  # seconds before each answer (a busy endpoint)
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests.append(
                    {"path": self.path, "json": json.loads(body), "auth": self.headers.get("Authorization")}
                )
                chars = sum(len(m.get("content") or "") for m in outer.requests[-1]["json"].get("messages", []))
                time.sleep(outer.delay_s)
                if outer.context_chars is not None and chars > outer.context_chars:
                    error = {"message": f"the prompt is {chars} characters", "code": "context_length_exceeded"}
                    payload, status = json.dumps({"error": error}).encode(), 400
                elif isinstance(reply := outer.replies.pop(0) if outer.replies else '{"skills": []}', int):
                    payload, status = b'{"error": "scripted failure"}', reply
                else:
                    msg = {"role": "assistant", "content": reply}
                    payload, status = json.dumps({"choices": [{"index": 0, "message": msg}]}).encode(), 200
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that timed out left
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)


@pytest.fixture
def llm() -> Iterator[ScriptedLLM]:
    """A running ScriptedLLM on a free port, shut down after the test."""
    server = ScriptedLLM()
    server.thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()
        server.thread.join(timeout=5)
