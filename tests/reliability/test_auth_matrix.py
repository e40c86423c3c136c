"""The auth matrix over every route of every server, generated from each app's own route table (a new route
cannot skip it): no key → 401 JSON, wrong key → 401 JSON, the right key → anything but 401; health is open."""

from __future__ import annotations

import re

import httpx
import pytest

SURFACES = ("policy_surface", "proxy_surface", "training_surface")


def flat_routes(routes, prefix: str = "") -> list[tuple[str, object]]:
    """(full path, route) for every route, routers included with `include_router` (FastAPI keeps them nested)."""
    out = []
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            out.extend(flat_routes(included.routes, prefix + route.include_context.prefix))
        else:
            out.append((prefix + route.path, route))
    return out


def routes(app) -> list[tuple[str, str]]:
    """(method, concrete path) for every HTTP route; path parameters filled with a placeholder."""
    out = []
    for full_path, route in flat_routes(app.routes):
        methods = sorted(getattr(route, "methods", None) or [])
        path = re.sub(r"\{[^}]+\}", "x", full_path)
        out.extend((m, path) for m in methods if m != "HEAD")
    assert out, "no routes found"
    return out


def send(surface, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    body = b"{}" if method in ("POST", "PUT", "PATCH") else None
    headers = {**headers, "content-type": "application/json"}
    return httpx.request(method, f"{surface.url}{path}", content=body, headers=headers, timeout=120)


@pytest.mark.parametrize("name", SURFACES)
def test_every_route_needs_the_key_except_health(name, request):
    surface = request.getfixturevalue(name)
    table = routes(surface.app)
    assert any(p in surface.open_paths for _, p in table), "the health route is missing from the table"
    for method, path in table:
        if path in surface.open_paths:
            assert send(surface, method, path, {}).status_code == 200, (method, path)
            continue
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"x-api-key": "wrong-key"}):
            r = send(surface, method, path, headers)
            assert r.status_code == 401, (surface.name, method, path, headers, r.status_code)
            assert r.json()["error"]["type"] == "authentication_error"
        r = send(surface, method, path, surface.headers())
        assert r.status_code != 401 and r.status_code < 500, (surface.name, method, path, r.status_code, r.text)
    assert surface.alive()


def test_the_route_tables_cover_the_documented_routes(policy_surface, proxy_surface):
    policy = {p for _, p in routes(policy_surface.app)}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter", "/health", "/openapi.json"} <= policy  # fmt: skip
    proxy = {p for _, p in routes(proxy_surface.app)}
    assert {"/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/v1/sessions/done",
            "/health", "/openapi.json"} <= proxy  # fmt: skip
