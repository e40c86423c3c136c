"""Schemathesis against each server's own published OpenAPI document (request body schemas included): bounded
examples per operation, no 5xx, and the server still healthy afterwards."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

BOUNDS = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "n": 2, "top_logprobs": 2}
EXAMPLES = settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def bounded(doc: dict) -> dict:
    """The published document with generation kept cheap on a CPU model: few tokens, few choices, short lists."""

    def walk(node):
        if isinstance(node, dict):
            for key, value in list(node.items()):
                if key == "properties" and isinstance(value, dict):
                    for name, limit in BOUNDS.items():
                        if isinstance(value.get(name), dict) and "type" in value[name]:
                            value[name]["maximum"] = limit
                if key == "model" and isinstance(value, dict) and value.get("type") == "string":  # a served model
                    # (others: 404, tested elsewhere)
                    node[key] = {"enum": ["tiny"]}
                    continue
                if key == "messages" and isinstance(value, dict) and value.get("type") == "array":
                    value["maxItems"] = 4
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(doc)
    return doc


def published(surface) -> schemathesis.schemas.BaseSchema:
    doc = httpx.get(f"{surface.url}/openapi.json", headers=surface.headers(), timeout=60).json()
    assert any("requestBody" in op.get("post", {}) for op in doc["paths"].values()), "no request body schemas"
    return schemathesis.openapi.from_dict(bounded(doc))


def fuzz(surface) -> dict[str, int]:
    """Every operation of the surface's published document, positive and negative cases; statuses seen."""
    schema = published(surface)
    seen: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method.upper() == "POST" else [])
        for mode in modes:  # negative cases need something to break: a body

            @given(case=operation.as_strategy(generation_mode=mode))
            @EXAMPLES
            def run(case) -> None:
                response = case.call(base_url=surface.url, headers=surface.headers(), timeout=120)
                key = f"{case.method} {case.path} {response.status_code}"
                seen[key] = seen.get(key, 0) + 1
                assert response.status_code < 500, (case.method, case.path, case.body, response.text)
                assert response.status_code != 401

            run()
    return seen


@pytest.mark.parametrize("name", ["policy_surface", "proxy_surface"])
def test_no_5xx_from_the_published_schema_and_alive_after(name, request):
    surface = request.getfixturevalue(name)
    seen = fuzz(surface)
    assert any(k.startswith("POST /v1/chat/completions 200") for k in seen), seen  # real answers, not only 4xx
    assert surface.alive()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2}
    r = httpx.post(f"{surface.url}/v1/chat/completions", json=body, headers=surface.headers(), timeout=120)
    assert r.status_code == 200, r.text
