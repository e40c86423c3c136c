"""Per-agent keys (`rollout.proxy.agent_keys: {key: agent_id}`): a key holder is pinned to its agent.

The proxy's own key (`rollout.proxy.api_key`) keeps full access. A request with an agent key:
- is answered as that agent: its `X-Agent-Id` is set to the pinned id (one naming another agent is a 403), so its
  turns are filed, scored and trained as that agent's and a derived session can only continue that agent's
  conversations (session fingerprints are keyed by agent);
- cannot reach `/control/*` or `/dashboard*` (they show and steer every agent): 403;
- may send `/v1/feedback` only about its own agent's turns (another agent's `response_id` is a 404, as an unknown
  one: whether it exists is not said).
Inside, the request then carries the proxy's key, so the routes behind behave as for the owner.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metaclaw.wire import CLIENT_HEADER
from metaclaw.wire.security import send_json_error

OWNER_ONLY = ("/control", "/dashboard")
MAX_FEEDBACK_BYTES = 1 << 20


def check_agent_keys(agent_keys: Mapping[str, str] | None, api_key: str | None) -> dict[str, str]:
    """The validated mapping; agent keys need the proxy's own key (else every caller is unauthenticated anyway)."""
    from metaclaw.agents import check_agent_id

    keys = dict(agent_keys or {})
    if keys and not api_key:
        raise ValueError("rollout.proxy.agent_keys needs rollout.proxy.api_key (the owner's key): without it the proxy "
                         "is open to every caller and a key pins no one")  # fmt: skip
    for key, agent in keys.items():
        if not isinstance(key, str) or len(key) < 16:
            raise ValueError("rollout.proxy.agent_keys: every key must be a string of at least 16 characters")
        if hmac.compare_digest(key.encode(), api_key.encode()):
            raise ValueError("rollout.proxy.agent_keys: an agent key equals rollout.proxy.api_key")
        check_agent_id(agent, f"rollout.proxy.agent_keys[...] (agent {agent!r})")
    return keys


class AgentKeyMiddleware:
    """Pins callers that present an agent key to their agent (see the module doc); others pass unchanged.

    Args:
        app: the proxy's app (with its own key check and the control routes inside).
        api_key: the proxy's own key.
        agent_keys: key -> agent id (`check_agent_keys`).
        store: the sample store (feedback by `response_id` is checked against the turn's agent).
    """

    def __init__(self, app: ASGIApp, api_key: str, agent_keys: Mapping[str, str], store: Any = None) -> None:
        self.app, self.api_key, self.store = app, api_key, store
        self.agent_keys = [(k.encode(), a) for k, a in agent_keys.items()]

    @staticmethod
    def _token(scope: Scope) -> bytes:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
        return (auth[7:] if auth[:7].lower() == b"bearer " else auth).strip()

    @staticmethod
    def _scope(token: bytes) -> str:
        """The caller's partition (`CLIENT_HEADER`): a digest of its key, never the key."""
        return "k" + hashlib.blake2b(token, digest_size=8, person=b"metaclaw-client").hexdigest()

    def _pinned(self, scope: Scope) -> str | None:
        token = self._token(scope)
        found = None
        for key, agent in self.agent_keys:  # every key compared: the time taken does not say which one matched
            if hmac.compare_digest(token, key):
                found = agent
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        agent = self._pinned(scope)
        if agent is None:
            return await self.app(scope, receive, send)
        token = self._token(scope)
        path = scope["path"]
        if path.startswith(OWNER_ONLY):
            return await send_json_error(send, 403, "an agent key cannot use the control or dashboard routes",
                                         "permission_error")  # fmt: skip
        headers = [(k, v) for k, v in scope.get("headers") or [] if k not in (b"authorization", b"x-api-key")]
        named = [v.decode("latin-1") for k, v in headers if k == b"x-agent-id"]
        if any(n != agent for n in named):
            anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")  # Anthropic's error shape there
            return await send_json_error(send, 403, f"this key is for agent {agent!r}, not {named[0]!r}",
                                         "permission_error", anthropic)  # fmt: skip
        headers = [(k, v) for k, v in headers if k not in (b"x-agent-id", CLIENT_HEADER.encode())]
        headers += [(b"authorization", b"Bearer " + self.api_key.encode()), (b"x-agent-id", agent.encode()),
                    (CLIENT_HEADER.encode(), self._scope(token).encode())]  # fmt: skip
        scope = {**scope, "headers": headers}
        if path == "/v1/feedback" and scope["method"] == "POST":
            body, receive = await _read_body(receive)
            if body is None:
                return await send_json_error(send, 413, f"feedback body over {MAX_FEEDBACK_BYTES} bytes",
                                             "invalid_request_error")  # fmt: skip
            problem = self._feedback_problem(body, agent)
            if problem:
                status, message = problem
                return await send_json_error(send, status, message, "not_found_error" if status == 404 else
                                             "permission_error")  # fmt: skip
        return await self.app(scope, receive, send)

    def _feedback_problem(self, body: bytes, agent: str) -> tuple[int, str] | None:
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            return None  # the route answers the 400
        if not isinstance(data, dict):
            return None
        if data.get("agent_id") not in (None, agent):
            return 403, f"this key is for agent {agent!r}, not {data['agent_id']!r}"
        rid = data.get("response_id")
        if isinstance(rid, str) and self.store is not None:
            found = self.store.by_response_id(rid.removeprefix("msg_"))
            if found and found[0].agent_id != agent:
                return 404, f"no captured turn has response_id {rid!r}"
        return None


async def _read_body(receive: Receive) -> tuple[bytes | None, Receive]:
    """The whole request body (None: over `MAX_FEEDBACK_BYTES`), and a `receive` that hands it to the app again."""
    chunks, more, size = [], True, 0
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_FEEDBACK_BYTES:
            return None, receive
        more = message.get("more_body", False)
    body, sent = b"".join(chunks), False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay
