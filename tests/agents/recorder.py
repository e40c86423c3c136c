"""A recording pass-through: the agent talks to it, it forwards every request to the proxy unchanged and writes
what the agent sent (method, path, query, headers without credentials, JSON body) as one JSON line per request.

`make test-agents` puts it between each agent and `train.py rollout=proxy`; the lines it writes, scrubbed
(`scrub`), are the conformance fixtures in tests/conformance/recorded/ (docs/clients.md "Recorded traffic").
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

CREDENTIAL_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}
# Generated text in a reply's bytes, per API (a non-empty string): chat chunks' `content`, Anthropic's text deltas,
# Responses' `delta`, tool-call `arguments`.
CONTENT = re.compile(rb'"(?:content|text|delta|arguments|partial_json)"\s*:\s*"(?!")')
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}
# Machine-specific text in the agents' prompts: home folders, temp dirs, user names, dates, uuids.
_SCRUB = [
    (re.compile(r"/(?:tmp|root|home/[^/\s\"']+)(?:/[^\s\"'`)]*)?"), "/workspace"),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "00000000-0000-0000-0000-0"),
]


def scrub(value: Any, secrets: tuple[str, ...] = ()) -> Any:
    """`value` with the given secrets replaced by `<redacted>` and machine paths and uuids made neutral."""
    if isinstance(value, str):
        for s in secrets:
            if s:
                value = value.replace(s, "<redacted>")
        for pattern, repl in _SCRUB:
            value = pattern.sub(repl, value)
        return value
    if isinstance(value, list):
        return [scrub(v, secrets) for v in value]
    if isinstance(value, dict):
        return {k: scrub(v, secrets) for k, v in value.items()}
    return value


class Recorder:
    """Forward `http://host:port/...` to `upstream`, appending each request to `out` (JSON lines)."""

    def __init__(self, upstream: str, out: Path, port: int, label: str) -> None:
        self.upstream, self.out, self.port, self.label = upstream.rstrip("/"), out, port, label
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0))
        self.count = 0
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST", "HEAD", "OPTIONS"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Recorder:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("recorder did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def _write(self, request: Request, raw: bytes, timing: dict[str, float] | None = None) -> None:
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = {"<non-json bytes>": len(raw)}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in CREDENTIAL_HEADERS | HOP_HEADERS}
        line = {
            "agent": self.label,
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": headers,
            "body": body,
            "timing": timing or {},
        }
        with self._lock, self.out.open("a") as f:
            f.write(json.dumps(line) + "\n")
            self.count += 1

    async def forward(self, request: Request) -> Response:
        """Pass the request on; its line is written when the reply ends, with the time to the first reply byte
        that carries generated text (`first_token_s`, a streamed reply's first content delta) and in all."""
        raw = await request.body()
        start = time.monotonic()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        url = f"{self.upstream}{request.url.path}" + (f"?{request.url.query}" if request.url.query else "")
        upstream = await self.client.send(
            self.client.build_request(request.method, url, headers=headers, content=raw), stream=True
        )
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}

        async def body():
            timing: dict[str, float] = {"status": upstream.status_code}
            try:
                async for chunk in upstream.aiter_raw():
                    if "first_token_s" not in timing and CONTENT.search(chunk):
                        timing["first_token_s"] = round(time.monotonic() - start, 3)
                    yield chunk
            finally:
                await upstream.aclose()
                timing["total_s"] = round(time.monotonic() - start, 3)
                self._write(request, raw, timing)

        return StreamingResponse(body(), status_code=upstream.status_code, headers=out_headers)


def main() -> None:  # pragma: no cover - a tool: `python -m tests.agents.recorder UPSTREAM OUT PORT LABEL`
    import sys

    upstream, out, port, label = sys.argv[1:5]
    with Recorder(upstream, Path(out), int(port), label):
        print(f"recording {label} on 127.0.0.1:{port} -> {upstream}", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
