"""What every HTTP surface owes the user: bearer-key auth, payload limits, and paths confined to a root.

Both middlewares are plain ASGI, so they sit in front of LitServe, FastAPI or Starlette apps alike and
answer with an OpenAI-style JSON error body.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send


def error_body(message: str, type_: str = "invalid_request_error", code: int | str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "code": code}}).encode()


async def send_json_error(send: Send, status: int, message: str, type_: str) -> None:
    body = error_body(message, type_, status)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """Constant-time check of an `Authorization: Bearer <key>` header (also accepts `x-api-key: <key>`)."""
    if not authorization:
        return False
    token = authorization[7:] if authorization[:7].lower() == "bearer " else authorization
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


class BearerAuthMiddleware:
    """401 with a JSON body unless the request carries the key; `open_paths` (e.g. `/health`) stay open.

    Args:
        app: the ASGI app to protect.
        api_key: the key; empty or None disables the check.
        open_paths: exact paths that need no key.
        extra_keys: other accepted spellings of the key (the training server accepts `tml-<key>`, the form the
            Tinker SDK insists on).
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        open_paths: Iterable[str] = ("/health",),
        extra_keys: Iterable[str] = (),
    ) -> None:
        self.app, self.api_key, self.open_paths = app, api_key or "", frozenset(open_paths)
        self.extra_keys = tuple(k for k in extra_keys if k) if self.api_key else ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.api_key or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization") or headers.get(b"x-api-key")
        given = auth.decode("latin-1") if auth else None
        if not any(bearer_matches(given, key) for key in (self.api_key, *self.extra_keys)):
            return await send_json_error(send, 401, "missing or invalid API key", "authentication_error")
        return await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for request bodies over `max_bytes`, declared (Content-Length) or chunked.

    The body is read in full before the app runs (bodies here are bounded JSON), so an oversized chunked upload
    is refused with 413 JSON instead of failing inside the app after a response may have started.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = f"request body exceeds the {self.max_bytes}-byte limit"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_json_error(send, 413, too_big, "invalid_request_error")
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before the body was complete
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await send_json_error(send, 413, too_big, "invalid_request_error")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls: disconnect detection

        await self.app(scope, replay, send)


def confine_path(root: str | os.PathLike, user_path: str | os.PathLike, field: str = "path") -> Path:
    """Resolve `user_path` (relative to `root`, or absolute) and refuse anything outside `root`.

    Raises:
        ValueError: naming `field`, when the path escapes the root (`..`, absolute elsewhere, symlinks).
    """
    base = Path(root).resolve()
    candidate = Path(user_path)
    if not str(user_path) or "\x00" in str(user_path):
        raise ValueError(f"{field} must be a non-empty path")
    resolved = (candidate if candidate.is_absolute() else base / candidate).resolve()
    if resolved != base and base not in resolved.parents:
        raise ValueError(f"{field} {str(user_path)!r} is outside the allowed directory {str(base)!r}")
    return resolved


def resolve_api_key(configured: str | None, env_var: str = "METACLAW_API_KEY") -> str | None:
    """The key from the environment, else the config; None when neither sets one."""
    return os.environ.get(env_var) or configured or None


def open_server_warning(server: str, host: str, port: int, how_to_set: str = "METACLAW_API_KEY") -> str:
    """The WARNING a server started without a key logs: who can reach it, and how to close it."""
    loopback = host in ("127.0.0.1", "::1", "localhost")
    who = "every user and process on this machine" if loopback else f"anyone who can reach {host} on the network"
    return (f"{server} on {host}:{port} has no API key: {who} can use every route (chat, adapters, ...). "
            f"Set {how_to_set} to require `Authorization: Bearer <key>`.")  # fmt: skip
