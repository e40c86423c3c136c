"""One error body: the policy server, the proxy, the training server and the security middlewares all answer with
`metaclaw.wire.errors`' shape, `{"error": {"message", "type", "param", "code"}}` (Anthropic's on its routes)."""

from __future__ import annotations

import asyncio
import json

from metaclaw.rollout.errors import proxy_error, upstream_response
from metaclaw.serving.litapi import error_reply
from metaclaw.training_server.errors import _reply
from metaclaw.wire import RequestError
from metaclaw.wire.errors import error_body, error_response
from metaclaw.wire.security import send_json_error

KEYS = {"message", "type", "param", "code"}


def _sent(status: int, message: str, type_: str, anthropic: bool = False) -> dict:
    messages: list[dict] = []

    async def send(message: dict) -> None:
        messages.append(message)

    asyncio.run(send_json_error(send, status, message, type_, anthropic))
    return json.loads(messages[1]["body"])


def test_every_surface_answers_the_one_body():
    bodies = {
        "policy server": json.loads(error_reply(RequestError("bad n", param="n")).body),
        "training server": json.loads(_reply(400, "bad n", "n").body),
        "proxy": json.loads(proxy_error(400, "bad n", anthropic=False, param="n").body),
        "proxy upstream": json.loads(upstream_response(400, b'{"error": {"message": "bad n"}}', anthropic=False).body),
        "middleware": _sent(400, "bad n", "invalid_request_error"),
        "wire": error_body("bad n", 400, param="n"),
    }
    for where, body in bodies.items():
        assert set(body) == {"error"} and set(body["error"]) == KEYS, where
        assert body["error"]["message"] == "bad n" and body["error"]["type"] == "invalid_request_error", where


def test_codes_follow_each_clients_sdk_and_types_follow_the_status():
    assert json.loads(_reply(404, "no session").body)["error"]["code"] == 404  # vLLM's shape: the status
    assert json.loads(proxy_error(404, "no", anthropic=False, code=404).body)["error"]["code"] is None  # OpenAI's
    assert error_body("x", 429)["error"]["type"] == "rate_limit_error"
    assert json.loads(_reply(429, "full").body)["error"]["type"] == "session_limit_error"
    assert error_body("x", 503)["error"]["type"] == "server_error"
    reply = error_response("who?", 401)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"


def test_anthropic_routes_get_anthropics_body():
    proxy = json.loads(proxy_error(413, "big", anthropic=True).body)
    for body in (proxy, _sent(413, "big", "request_too_large", True)):
        assert body == {"type": "error", "error": {"type": "request_too_large", "message": "big"}}
