"""What every HTTP surface owes the user: bearer-key auth, payload limits, requests only from the user's own
clients (not from web pages: `BrowserGuardMiddleware`), and paths confined to a root.

The middlewares are plain ASGI, so they sit in front of LitServe, FastAPI or Starlette apps alike and answer
with an OpenAI-style JSON error body (Anthropic's shape on the paths named `anthropic_paths`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from metaclaw.wire.errors import anthropic_error_body, error_body


async def send_json_error(
    send: Send, status: int, message: str, type_: str, anthropic: bool = False, code: str | None = None
) -> None:
    """A JSON error response: OpenAI's `{"error": {...}}`, or Anthropic's `{"type": "error", ...}`."""
    data = anthropic_error_body(message, status, type_) if anthropic else error_body(message, status, type_, code)
    body = json.dumps(data).encode()
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
            Tinker SDK insists on), or other keys (the control routes accept the proxy's key too).
        anthropic_paths: path prefixes answered with Anthropic's error shape (the proxy's `/v1/messages`).
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        open_paths: Iterable[str] = ("/health",),
        extra_keys: Iterable[str] = (),
        anthropic_paths: Iterable[str] = (),
    ) -> None:
        self.app, self.api_key, self.open_paths = app, api_key or "", frozenset(open_paths)
        self.extra_keys = tuple(k for k in extra_keys if k) if self.api_key else ()
        self.anthropic_paths = tuple(anthropic_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.api_key or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization") or headers.get(b"x-api-key")
        given = auth.decode("latin-1") if auth else None
        if not any(bearer_matches(given, key) for key in (self.api_key, *self.extra_keys)):
            anthropic = scope["path"].startswith(self.anthropic_paths)
            return await send_json_error(send, 401, "missing or invalid API key", "authentication_error", anthropic,
                                         "invalid_api_key")  # fmt: skip
        return await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for request bodies over `max_bytes`, declared (Content-Length) or chunked.

    The body is read in full before the app runs (bodies here are bounded JSON), so an oversized chunked upload
    is refused with 413 JSON instead of failing inside the app after a response may have started.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, anthropic_paths: Iterable[str] = ()) -> None:
        self.app, self.max_bytes, self.anthropic_paths = app, max_bytes, tuple(anthropic_paths)

    async def _too_big(self, scope: Scope, send: Send) -> None:
        message = f"request body exceeds the {self.max_bytes}-byte limit"
        if self.anthropic_paths and scope["path"].startswith(self.anthropic_paths):
            return await send_json_error(send, 413, message, "request_too_large", anthropic=True)
        return await send_json_error(send, 413, message, "invalid_request_error", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_big(scope, send)
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before the body was complete
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await self._too_big(scope, send)
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


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JSON_TYPE = "application/json"


def host_name(authority: str) -> str:
    """The host of a `Host` header or an origin's authority, without port or IPv6 brackets, lowercased."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class BrowserGuard:
    """Who may talk to a local HTTP service: the user's own clients, not a web page the user happens to visit.

    A page in the user's browser can send requests to `http://127.0.0.1:<port>` (a form post or a `no-cors`
    fetch with a `text/plain` body needs no CORS preflight), and with DNS rebinding it can even read the answers.
    Three checks close that, each answering with a JSON error:

    - `Host` must name this server (DNS rebinding sends the attacker's host name): 403.
    - `Origin`, when sent, must be this server's own (same-origin) or one of `allowed_origins`; a browser's
      `Sec-Fetch-Site: cross-site|same-site` is refused too (a navigation or `<img>` sends no Origin): 403.
    - State-changing methods (POST, PUT, PATCH, DELETE) must declare `Content-Type: application/json`: 415
      (a JSON content type from a page needs a preflight, which this server never grants).

    Real SDKs (openai, anthropic, httpx) send JSON and no Origin, so they pass.

    Args:
        bind_host: the address the server listens on: loopback (the default) allows `127.0.0.1`, `localhost`
            and `::1`; a wildcard (`0.0.0.0`, `::`) also allows any IP literal and this machine's host name.
        allowed_hosts: further host names the server may be reached as (e.g. a name in /etc/hosts).
        allowed_origins: further origins allowed to call (e.g. `http://localhost:5173`); empty: same-origin only.
        anthropic_paths: path prefixes answered with Anthropic's error shape.
    """

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    anthropic_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bound = host_name(self.bind_host) if self.bind_host not in WILDCARD_HOSTS else self.bind_host
        names = {*LOOPBACK_HOSTS, bound, *(host_name(h) for h in self.allowed_hosts)}
        if bound not in LOOPBACK_HOSTS:  # reachable from the network: by this machine's name too
            names.add(socket.gethostname().lower())
        object.__setattr__(self, "_names", frozenset(n for n in names if n))
        object.__setattr__(self, "_any_ip", bound in WILDCARD_HOSTS)
        object.__setattr__(self, "_origins", frozenset(o.rstrip("/").lower() for o in self.allowed_origins))

    def host_allowed(self, host: str | None) -> bool:
        if host is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = host_name(host)
        return name in self._names or (self._any_ip and _is_ip(name))

    def problem(self, method: str, headers: dict[bytes, bytes], checks: str = "all") -> tuple[int, str, str] | None:
        """`(status, message, error type)` when the request must be refused, else None.

        `checks`: `all`, `origin` (Host and Origin only) or `content_type` (the JSON content type only), so the
        content type can be checked after the key (a keyless request is told 401 first).
        """
        if checks == "content_type":
            return self._content_type(method, headers)
        host = headers.get(b"host")
        host_text = host.decode("latin-1") if host is not None else None
        if not self.host_allowed(host_text):
            names = ", ".join(sorted(self._names))
            why = f"Host {host_text!r} is not this server's name (DNS rebinding?); allowed: {names} (allowed_hosts)"
            return 403, why, "permission_error"
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1").strip().rstrip("/").lower()
            same = host_text is not None and urlsplit(text).netloc == host_text.strip().lower()
            if not same and text not in self._origins:
                return 403, f"requests from the web origin {text!r} are refused (cross-origin)", "permission_error"
        elif headers.get(b"sec-fetch-site", b"").lower() in (b"cross-site", b"same-site"):
            return 403, "requests from another web site are refused (cross-origin)", "permission_error"
        return self._content_type(method, headers) if checks == "all" else None

    @staticmethod
    def _content_type(method: str, headers: dict[bytes, bytes]) -> tuple[int, str, str] | None:
        if method in STATE_CHANGING:
            ctype = headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()
            if ctype != JSON_TYPE:
                shown = repr(ctype) if ctype else "none"
                return 415, f"Content-Type must be application/json (got {shown})", "invalid_request_error"
        return None

    def around(self, app: ASGIApp, checks: str = "all") -> BrowserGuardMiddleware:
        """This guard as a middleware in front of `app` (`checks` as in `problem`)."""
        return BrowserGuardMiddleware(app, guard=self, checks=checks)

    def around_auth(self, app: ASGIApp, auth: Callable[[ASGIApp], ASGIApp]) -> BrowserGuardMiddleware:
        """Host and Origin, then `auth(...)`, then the content type, then `app`: the usual stack."""
        return self.around(auth(self.around(app, "content_type")), "origin")

    def with_anthropic_paths(self, *paths: str) -> BrowserGuard:
        return replace(self, anthropic_paths=(*self.anthropic_paths, *paths))


class BrowserGuardMiddleware:
    """`BrowserGuard`'s checks in front of an ASGI app (every route, health included).

    Build it with `BrowserGuardMiddleware(app, guard=BrowserGuard(bind_host, allowed_hosts))`, or with the
    guard's fields as keywords (LitServe's `middlewares=[(BrowserGuardMiddleware, {...})]`); `checks="origin"`
    outside the key check and `checks="content_type"` inside it answer a keyless request 401 before 415.
    """

    def __init__(self, app: ASGIApp, guard: BrowserGuard | None = None, checks: str = "all", **fields: object) -> None:
        for name in ("allowed_hosts", "allowed_origins", "anthropic_paths"):
            if name in fields:
                fields[name] = tuple(fields[name] or ())  # type: ignore[arg-type]
        self.app, self.guard, self.checks = app, guard or BrowserGuard(**fields), checks  # type: ignore[arg-type]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.guard.problem(scope["method"], dict(scope.get("headers") or []), self.checks)
        if refused is not None:
            anthropic = scope["path"].startswith(self.guard.anthropic_paths)
            return await send_json_error(send, *refused, anthropic=anthropic)
        return await self.app(scope, receive, send)


def browser_guard_dependency(guard: BrowserGuard):
    """The same checks as a FastAPI dependency, for routes mounted outside a guarded app:
    `APIRouter(dependencies=[Depends(browser_guard_dependency(guard))])`."""
    from fastapi import HTTPException, Request

    def check(request: Request) -> None:
        refused = guard.problem(request.method, dict(request.scope.get("headers") or []))
        if refused is not None:
            raise HTTPException(refused[0], refused[1])

    return check


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
