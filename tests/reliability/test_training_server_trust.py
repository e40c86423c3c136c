"""Issue 31, findings 6 and 10: the training server checks the key before it reads a body, and a key holder cannot
load (or probe) any directory as a base model."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from metaclaw.config import ConfigError
from metaclaw.training_server.settings import ServerSettings
from tests.reliability.conftest import Surface, serve_cfg

CHUNK = b"x" * (1 << 20)


def _upload(app, chunks: int, headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """Send a chunked POST of `chunks` MiB straight into the ASGI app; returns (status, body bytes it read)."""
    read = 0
    sent = 0
    status = 0

    async def receive() -> dict:
        nonlocal read, sent
        if sent >= chunks:
            return {"type": "http.disconnect"}
        sent += 1
        read += len(CHUNK)
        return {"type": "http.request", "body": CHUNK, "more_body": sent < chunks}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/train/forward_backward", "raw_path": b"/v1/train/forward_backward", "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80),
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                    (b"transfer-encoding", b"chunked"), *headers],
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    return status, read


def test_keyless_chunked_upload_is_refused_before_its_body_is_read(training_surface: Surface) -> None:
    """Four keyless 60 MiB uploads cost +241 MiB RSS on old main: the size limit buffered before auth ran."""
    status, read = _upload(training_surface.app, chunks=60, headers=[])
    assert status == 401
    assert read == 0  # not one chunk pulled off the wire
    wrong = [(b"authorization", b"Bearer not-the-key")]
    assert _upload(training_surface.app, chunks=60, headers=wrong) == (401, 0)
    # with the key the body is read (and an oversized one still ends in 413, no more than the limit + one chunk)
    ok = [(b"authorization", f"Bearer {training_surface.key}".encode())]
    status, read = _upload(training_surface.app, chunks=66, headers=ok)
    assert status == 413 and 64 << 20 < read <= (65 << 20)


@pytest.mark.parametrize("probe", ["/etc", "/nonexistent/dir", "/tmp"])
def test_base_model_switch_is_off_and_does_not_echo_filesystem_probes(training_surface: Surface, probe: str) -> None:
    r = httpx.post(f"{training_surface.url}/v1/lora/create", json={"base_model": probe, "rank": 4},
                   headers=training_surface.headers(), timeout=60)  # fmt: skip
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert message == f"base_model {probe!r} is not the served model 'tiny' nor one of app.allowed_base_models"


def test_switching_on_needs_an_allow_list() -> None:
    cfg = serve_cfg("app=training_server", "model=tiny", "devices=cpu", "app.allow_base_model_switch=true")
    with pytest.raises(ConfigError, match="app.allowed_base_models"):
        ServerSettings.from_config(cfg)
    cfg = serve_cfg("app=training_server", "model=tiny", "devices=cpu", "app.allow_base_model_switch=true",
                    "app.allowed_base_models=[Qwen/Qwen3-4B]")  # fmt: skip
    assert ServerSettings.from_config(cfg).allowed_base_models == ("Qwen/Qwen3-4B",)
    cfg = serve_cfg("app=training_server", "model=tiny", "devices=cpu", "app.allowed_base_models=[Qwen/Qwen3-4B]")
    assert ServerSettings.from_config(cfg).allowed_base_models == ()  # the list alone does not switch it on


def test_a_web_page_cannot_reach_the_training_server(training_surface: Surface) -> None:
    """Issue 31, finding 1 on the training server too: a foreign Origin or a rebinding Host is refused (403) before
    the key is even looked at; the server's own clients (no Origin, loopback Host) are not."""
    key = [(b"authorization", f"Bearer {training_surface.key}".encode())]
    assert _upload(training_surface.app, chunks=1, headers=[(b"origin", b"https://evil.example"), *key])[0] == 403
    scope_host = [(b"origin", b"http://127.0.0.1")]  # same-origin: passes the guard, then the key decides
    assert _upload(training_surface.app, chunks=1, headers=scope_host)[0] == 401
