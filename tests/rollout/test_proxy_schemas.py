"""One schema for the proxy: each route validates its JSON body with the pydantic model `/openapi.json` publishes
(`metaclaw.wire.proxy_schemas`), so the document cannot drift from what the proxy accepts: a body that breaks it is
a 400 naming the field in the route's error shape, and every request the agents were recorded sending passes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from metaclaw.wire.proxy_schemas import PROXY_BODIES, PROXY_SCHEMAS
from metaclaw.wire.schemas import openapi_schema, validated

RECORDED = Path(__file__).parents[1] / "conformance" / "recorded"
MSG = [{"role": "user", "content": "hi"}]


def test_the_published_bodies_are_the_validating_schemas(harness):
    doc = httpx.get(f"{harness.url}/openapi.json", timeout=10).json()
    for path, schema in PROXY_SCHEMAS.items():
        assert PROXY_BODIES[path] == openapi_schema(schema), path
        published = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert published == openapi_schema(schema), path
        assert "$ref" not in json.dumps(published) and "$defs" not in json.dumps(published), path


def recorded() -> list[dict]:
    return [json.loads(line) for f in sorted(RECORDED.glob("*.jsonl")) for line in f.read_text().splitlines() if line]


def test_every_recorded_agent_request_validates():
    records = [r for r in recorded() if r["method"] == "POST" and r["path"] in PROXY_SCHEMAS]
    assert {r["agent"] for r in records} >= {"claude-code", "codex", "openclaw"}, {r["agent"] for r in records}
    for r in records:
        validated(PROXY_SCHEMAS[r["path"]], r["body"])
    # the shape the hand-written document refused: Claude Code 2.x's system turn inside `messages`
    assert any(m.get("role") == "system" for r in records if r["path"] == "/v1/messages" for m in r["body"]["messages"])


# (route, a body breaking its schema, the field the 400 names); each passes the JSON parse and reaches the gate
BAD = [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "top_k": -2}, "top_k"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [{"type": 3}]}]},
     "messages.0.content.0.type"),
    ("/v1/completions", {"model": "m", "prompt": 7}, "prompt"),
    ("/v1/messages", {"model": "m", "max_tokens": True, "messages": MSG}, "max_tokens"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
     "messages.0.content.0.tool_use.name"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": []}, "messages"),
    ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"model": "m", "input": [{"type": "function_call_output", "call_id": ""}]},
     "input.0.function_call_output.call_id"),
    ("/v1/sessions/done", {"session_id": 5}, "session_id"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field"), BAD)
def test_a_body_breaking_the_schema_is_a_400_naming_the_field_in_the_routes_shape(harness, path, body, field):
    r = httpx.post(f"{harness.url}{path}", json=body, timeout=10)
    assert r.status_code == 400, r.text
    out = r.json()
    if path.startswith("/v1/messages"):
        assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error", out
    else:
        assert out["error"]["type"] == "invalid_request_error" and "code" in out["error"], out
    assert out["error"]["message"].startswith(f"{field}:"), out


@pytest.mark.parametrize("path", sorted(PROXY_SCHEMAS))
def test_a_body_that_is_not_an_object_is_a_400(harness, path):
    r = httpx.post(f"{harness.url}{path}", json=[1], timeout=10)
    assert r.status_code == 400 and "must be a JSON object" in r.text, r.text
