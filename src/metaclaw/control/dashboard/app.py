"""The dashboard's HTTP routes: `GET /dashboard` (the page), `/dashboard/static/*` (its script and style, shipped in
the package: no CDN, no build step) and `GET /dashboard/api/state` (every figure, `DashboardData.state`).

The page and its two assets load without a key (they hold no data); the data route needs the key in the
`Authorization` header (the page asks for it once and keeps it in sessionStorage; it never goes in a URL). The
page's buttons are the control plane's own routes (`POST /control/pause|resume|train-now|rollback`) and the proxy's
`POST /v1/feedback`, with `application/json` bodies and the same key: nothing changes state on a GET. Every
`/dashboard` path answers loopback clients only; the page is sent with a strict Content-Security-Policy (own
origin only, no inline script).
"""

from __future__ import annotations

import asyncio
import logging
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from metaclaw.control.dashboard.data import DashboardData
from metaclaw.wire.security import BearerAuthMiddleware, BrowserGuard, send_json_error

log = logging.getLogger(__name__)
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost", "testclient"})
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")  # fmt: skip
HEADERS = {"cache-control": "no-store", "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}


def _asset(name: str) -> bytes:
    return resources.files("metaclaw.control.dashboard").joinpath("static", name).read_bytes()


def create_dashboard_app(data: DashboardData, key_required: bool = True) -> FastAPI:
    """The routes (no auth here: `mount_dashboard` adds it to the data route); `GET /dashboard/api/auth` says whether
    the data needs a key (a finished run's page on loopback needs none), so the page asks only when it does."""
    app = FastAPI(title="metaclaw dashboard", openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/dashboard/api/auth")
    async def auth() -> Any:
        return JSONResponse({"key_required": key_required}, headers=HEADERS)

    @app.get("/dashboard")
    async def page() -> Response:
        return Response(_asset("index.html"), media_type="text/html; charset=utf-8",
                        headers={**HEADERS, "content-security-policy": CSP})  # fmt: skip

    @app.get("/dashboard/static/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:  # a fixed list: no path from the request reaches the file system
            return JSONResponse({"error": {"message": f"no asset {name!r}", "code": 404}}, status_code=404)
        return Response(_asset(name), media_type=ASSETS[name], headers=HEADERS)

    @app.get("/dashboard/api/state")
    async def state() -> Any:
        return JSONResponse(await asyncio.to_thread(data.state), headers=HEADERS)

    return app


def mount_dashboard(app: ASGIApp | None, data: DashboardData, api_key: str, guard: BrowserGuard | None = None,
                    ) -> ASGIApp:  # fmt: skip
    """`app` with `/dashboard*` in front of it (loopback only; Host / Origin checked by `guard`, the proxy's or a
    loopback one; the data route behind `api_key`); `app` None: the dashboard alone (a finished run's read-only
    server)."""
    routes = create_dashboard_app(data, key_required=bool(api_key))
    shell = ("/dashboard", "/dashboard/api/auth", *(f"/dashboard/static/{a}" for a in ASSETS))  # no data in these
    guarded = (guard or BrowserGuard()).around_auth(
        routes, lambda inner: BearerAuthMiddleware(inner, api_key, open_paths=shell)
    )

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path == "/dashboard" or path.startswith("/dashboard/"):
                if (scope.get("client") or ("",))[0] not in LOOPBACK:
                    return await send_json_error(send, 403, "the dashboard answers loopback clients only",
                                                 "permission_error")  # fmt: skip
                return await guarded(scope, receive, send)
            if app is None:
                return await send_json_error(send, 404, f"no route {path} (read-only dashboard)", "not_found_error")
        if app is None:
            return await routes(scope, receive, send)
        return await app(scope, receive, send)

    return dispatch
