"""The control HTTP API, `/control/*` on the proxy's port: loopback clients only, behind a per-run key.

`mount_plane(plane, app)` puts the control routes and the dashboard in front of the proxy's ASGI app;
`mount_control(app, plane, api_key)` wraps it: `/control/*` goes to the control routes, every
other request goes to the proxy untouched. `/v1/*` requests the proxy accepts count as user activity for the
scheduler; refused ones (401, 403, 413, 415) do not: a stranger's rejected requests must not keep training off.

The control routes need a key even when the proxy has none: a fresh one per run, written to
`<run dir>/control.key` (mode 0600) and read from there by `python -m metaclaw --run-dir DIR` (never in a URL
or an argument); the proxy's own key, when it has one, is accepted too. Host, Origin and the JSON content type
are checked as on the proxy (`metaclaw.wire.security.BrowserGuard`): a web page cannot pause or roll back.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.types import ASGIApp, Receive, Scope, Send

from metaclaw.agents import check_agent_id
from metaclaw.control.dashboard.app import mount_dashboard
from metaclaw.control.dashboard.data import DashboardData
from metaclaw.control.keys import issue_control_key, read_control_key
from metaclaw.control.plane import ControlError, ControlPlane
from metaclaw.wire.security import (
    BearerAuthMiddleware,
    BodySizeLimitMiddleware,
    BrowserGuard,
    BrowserGuardMiddleware,
    send_json_error,
)

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost", "testclient"})
REFUSED = frozenset({401, 403, 413, 415})  # answers that are not the user's activity


class TrainNowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    minutes: float | None = Field(default=None, gt=0, le=24 * 60)


class RollbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0, le=10**9)
    agent: str | None = None  # whose own adapter (None: the default one); the agent-id rule applies
    reset_trainer: bool = False  # the trainer goes back to it too (forget --rollback; metaclaw.modules.rewind)

    @field_validator("agent")
    @classmethod
    def _agent_id(cls, v: str | None) -> str | None:
        return None if v is None else check_agent_id(v, "agent")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "control_error", "code": status}}, status_code=status)


def create_control_app(plane: ControlPlane) -> FastAPI:
    """The `/control/*` routes (no auth here: `mount_control` adds it)."""
    app = FastAPI(title="metaclaw control", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(ControlError)
    async def _control_error(request: Request, exc: ControlError) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return _error(400, f"invalid request: {problems}")

    async def run(fn, *args) -> Any:  # the plane does blocking I/O (SQLite, the policy server)
        return await asyncio.to_thread(fn, *args)

    @app.get("/control/status")
    async def status() -> dict[str, Any]:
        return await run(plane.status)

    @app.post("/control/pause")
    async def pause() -> dict[str, Any]:
        return await run(plane.pause)

    @app.post("/control/resume")
    async def resume() -> dict[str, Any]:
        return await run(plane.resume)

    @app.post("/control/train-now")
    async def train_now(body: TrainNowBody | None = None) -> dict[str, Any]:
        return await run(plane.train_now, body.minutes if body else None)

    @app.post("/control/rollback")
    async def rollback(body: RollbackBody) -> dict[str, Any]:
        return await run(plane.rollback, body.step, body.agent, body.reset_trainer)

    return app


def mount_plane(plane: ControlPlane, app: ASGIApp) -> ASGIApp:
    """The proxy's ASGI app with `/control/*` and `/dashboard*` in front (the proxy's key, loopback only)."""
    guard = app.guard if isinstance(app, BrowserGuardMiddleware) else BrowserGuard()  # the proxy's Host/Origin
    controlled = mount_control(app, plane, plane.api_key)  # issues this run's control key
    data = DashboardData(plane.run_dir, plane=plane, **plane.dashboard)
    # the page's one key: the proxy's, else the run's control key (both open /control/*; docs/dashboard.md)
    key = plane.api_key or read_control_key(plane.run_dir)
    if not key:  # mount_control has just issued it
        raise RuntimeError(f"no control key in {plane.run_dir}: the dashboard would be open to anyone")
    return mount_dashboard(controlled, data, key, guard)


def mount_control(app: ASGIApp, plane: ControlPlane, api_key: str | None, max_body_bytes: int = 65536) -> ASGIApp:
    """`app` with `/control/*` mounted in front of it: loopback clients only, the run's control key (or the proxy's
    `api_key`), the same Host / Origin / content-type guard as `app` (a guarded proxy app's own, else loopback's)."""
    run_key = issue_control_key(plane.run_dir)
    guard = app.guard if isinstance(app, BrowserGuardMiddleware) else BrowserGuard()
    limited = BodySizeLimitMiddleware(create_control_app(plane), max_body_bytes)
    control = guard.around_auth(
        limited, lambda inner: BearerAuthMiddleware(inner, run_key, open_paths=(), extra_keys=(api_key or "",))
    )
    activity = plane.activity

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path.startswith("/control/") or path == "/control":
                client = (scope.get("client") or ("",))[0]
                if client not in LOOPBACK:
                    return await send_json_error(send, 403, "the control API answers loopback clients only",
                                                 "permission_error")  # fmt: skip
                return await control(scope, receive, send)
            if activity is not None and path.startswith("/v1/"):
                return await app(scope, receive, _touching(send, activity))
        return await app(scope, receive, send)

    return dispatch


def _touching(send: Send, activity: Any) -> Send:
    """`send` that marks user activity once the response starts, unless the request was refused (`REFUSED`)."""

    async def wrapped(message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] not in REFUSED:
            activity.touch()
        await send(message)

    return wrapped
