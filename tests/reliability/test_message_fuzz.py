"""A hypothesis fuzzer of the message shapes clients send the proxy (OpenAI, OpenClaw, Anthropic): valid and
broken parts, roles, tool calls and blocks, in front of the real tiny policy server. No 5xx, every 4xx is a
JSON error body, and the proxy still answers a normal turn afterwards."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
TEXT = st.text(max_size=40)
URL = st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "https://example.com/a.png", ""]) | JSON
ARGS = st.one_of(st.just('{"city": "Paris"}'), st.dictionaries(st.text(max_size=5), JSON, max_size=2), JSON)

OPENAI_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": URL}) | URL}),
    st.fixed_dictionaries({"type": st.just("image"), "data": st.just("iVBORw0KGgo=") | JSON,
                           "mimeType": st.just("image/png") | JSON}),
    st.fixed_dictionaries({"type": st.just("toolCall"), "id": TEXT, "name": TEXT | JSON, "arguments": ARGS}),
    st.fixed_dictionaries({"type": st.just("toolResult"), "toolCallId": TEXT | JSON, "content": TEXT | JSON}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url", "data"]), JSON, max_size=3),
    TEXT,
    JSON,
)  # fmt: skip
TOOL_CALL = st.one_of(
    st.fixed_dictionaries({"id": TEXT, "type": st.just("function"),
                           "function": st.fixed_dictionaries({"name": TEXT | JSON, "arguments": ARGS}) | JSON}),
    JSON,
)  # fmt: skip
OPENAI_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "toolResult", "bogus"]) | JSON},
    optional={
        "content": TEXT | st.lists(OPENAI_PART, max_size=3) | JSON,
        "tool_calls": st.lists(TOOL_CALL, max_size=2) | JSON,
        "tool_call_id": TEXT | JSON,
        "toolCallId": TEXT,
        "name": TEXT | JSON,
    },
)
OPENAI_TOOL = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": TEXT | JSON}, optional={"parameters": JSON, "description": TEXT})}),
    st.fixed_dictionaries({"name": TEXT | JSON}, optional={"input_schema": JSON}),
    JSON,
)  # fmt: skip
OPENAI_BODY = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(OPENAI_MESSAGE, min_size=1, max_size=4) | JSON,
     "max_tokens": st.just(2)},
    optional={"tools": st.lists(OPENAI_TOOL, max_size=2) | JSON, "stream": st.booleans(),
              "temperature": st.just(0.5) | JSON, "stop": JSON, "n": st.integers(0, 3)},
)  # fmt: skip

BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT | JSON}),
    st.fixed_dictionaries({"type": st.just("image"), "source": st.fixed_dictionaries(
        {"type": st.sampled_from(["base64", "url"])},
        optional={"media_type": st.just("image/png") | JSON, "data": st.just("iVBORw0KGgo=") | JSON,
                  "url": URL}) | JSON}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": TEXT | JSON, "input": JSON}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT | JSON,
                           "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                                      max_size=2) | JSON}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT}),
    JSON,
)  # fmt: skip
ANTHROPIC_BODY = st.fixed_dictionaries(
    {"model": st.just("claude"), "max_tokens": st.just(2) | JSON,
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]) | JSON,
                                                 "content": TEXT | st.lists(BLOCK, max_size=3) | JSON}),
                          min_size=1, max_size=3) | JSON},
    optional={"system": TEXT | JSON, "tools": st.lists(st.fixed_dictionaries(
        {"name": TEXT | JSON}, optional={"input_schema": JSON}), max_size=2) | JSON,
              "stop_sequences": JSON, "stream": st.booleans(), "tool_choice": JSON},
)  # fmt: skip

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def check(http: httpx.Client, path: str, body) -> None:
    content = json.dumps(body).encode()  # as Python writes it: NaN and Infinity included
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.status_code, r.text)
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json") and r.json()["error"]["message"], r.text


def test_fuzzed_message_shapes_never_5xx(proxy_surface):
    with httpx.Client(base_url=proxy_surface.url, headers=proxy_surface.headers(), timeout=120) as http:

        @given(body=OPENAI_BODY)
        @FUZZ
        def openai_shapes(body) -> None:
            check(http, "/v1/chat/completions", body)

        @given(body=ANTHROPIC_BODY)
        @FUZZ
        def anthropic_shapes(body) -> None:
            check(http, "/v1/messages", body)

        @given(body=ANTHROPIC_BODY)
        @settings(FUZZ, max_examples=30)
        def count_tokens_shapes(body) -> None:
            check(http, "/v1/messages/count_tokens", body)

        openai_shapes()
        anthropic_shapes()
        count_tokens_shapes()
        ok = {"model": "tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=ok).status_code == 200
    assert proxy_surface.alive()
