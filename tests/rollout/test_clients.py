"""How real clients meet the proxy (scripted upstream): images, malformed shapes, deep and oversized bodies,
response fidelity (model id, no extras), Anthropic stop sequences and usage, and the OpenAPI document."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from metaclaw.rollout.anthropic import AnthropicStream, to_anthropic_response
from tests.rollout.conftest import make_harness

PNG = "iVBORw0KGgo="
IMAGE_SHAPES = {
    "openai": {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
    "openclaw": {"type": "image", "data": PNG, "mimeType": "image/png"},
}


def chat(h, body, **kw) -> httpx.Response:
    return httpx.post(f"{h.url}/v1/chat/completions", json=body, timeout=30, **kw)


@pytest.mark.parametrize("shape", sorted(IMAGE_SHAPES))
def test_image_parts_never_fail_a_turn(harness, shape):
    content = [{"type": "text", "text": "what is in the picture"}, IMAGE_SHAPES[shape]]
    r = chat(harness, {"model": "m", "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    sent = harness.upstream_state["requests"][-1]["messages"][0]["content"]
    assert sent == "what is in the picture\n[image omitted: this model reads text only]"
    [s] = harness.store.select()
    assert s.status == "dropped" and s.meta["images"] == "placeholder" and s.meta["images_replaced"] == 1
    assert "text-only" in s.meta["dropped"]


def test_anthropic_image_block_gets_the_placeholder(harness):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    body = {"model": "claude-x", "max_tokens": 16,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": "describe"}]}]}  # fmt: skip
    r = httpx.post(f"{harness.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text"
    assert "[image omitted" in harness.upstream_state["requests"][-1]["messages"][0]["content"]
    assert harness.store.select()[0].status == "dropped"


def test_images_pass_through_when_the_upstream_declares_image_input(harness):
    harness.proxy.upstream_cards = {"tiny": {"id": "tiny", "input_modalities": ["text", "image"]}}
    content = [{"type": "text", "text": "look"}, IMAGE_SHAPES["openclaw"]]
    assert chat(harness, {"model": "m", "messages": [{"role": "user", "content": content}]}).status_code == 200
    sent = harness.upstream_state["requests"][-1]["messages"][0]["content"]
    assert sent[1] == {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    [s] = harness.store.select()
    assert s.status == "dropped" and s.meta["images"] == "passthrough"


MALFORMED_OPENAI = [
    [{"role": "assistant", "content": None, "tool_calls": [1]}],
    [{"role": "assistant", "content": None, "tool_calls": "call it"}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": 5}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 7}}]}],
    [{"role": "assistant", "content": [{"type": "toolCall", "function": "x"}]}],
    [{"role": "user", "content": [7]}],
    [{"role": "user", "content": [{"type": 5}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}],
    [{"role": "user", "content": [{"type": "toolResult", "toolCallId": {}, "content": "x"}]}],
    [{"role": "user", "content": {"text": "hi"}}],
    [{"role": "user", "content": "hi", "name": ["x"]}],
    [{"role": "toolResult", "toolCallId": "c", "content": 5}],
]


MALFORMED_TOOLS = [[1], [{"type": "function", "function": 3}], [{"name": "f", "input_schema": 4}]]


def test_malformed_openai_shapes_get_400_json_and_the_proxy_keeps_serving(harness):
    with httpx.Client(timeout=30) as http:  # one keep-alive connection: a 500 would have closed it
        for messages in MALFORMED_OPENAI:
            r = http.post(f"{harness.url}/v1/chat/completions", json={"model": "m", "messages": messages})
            assert r.status_code == 400, (messages, r.text)
            # the schema at the route's entry (`messages.0.…`) or the normaliser after it (`messages[0]…`)
            assert r.json()["error"]["message"].startswith(("messages.0", "messages[0]")), r.text
        for tools in MALFORMED_TOOLS:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
            r = http.post(f"{harness.url}/v1/chat/completions", json=body)
            assert r.status_code == 400, (tools, r.text)
            assert r.json()["error"]["message"].startswith(("tools.0", "tools[0]")), (tools, r.text)
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        assert http.post(f"{harness.url}/v1/chat/completions", json=body).status_code == 200


MALFORMED_ANTHROPIC = [
    {"messages": [{"role": "user", "content": [5]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": "x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
    {"messages": [{"role": "user", "content": "x"}], "system": 5},
    {"messages": [{"role": "user", "content": "x"}], "system": [{"type": "text"}]},
    {"messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"},
    {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": []}]},
]


def test_malformed_anthropic_shapes_get_400_in_anthropics_error_shape(harness):
    for body in MALFORMED_ANTHROPIC:
        r = httpx.post(f"{harness.url}/v1/messages", json={"model": "c", "max_tokens": 8, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    assert harness.store.count() == 0


JSON = {"content-type": "application/json"}  # raw bodies declare their type (else 415: docs/security.md)


def nested(depth: int) -> bytes:
    return b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * depth + b"]" * depth + b"}"


def test_deeply_nested_json_is_a_400(harness):
    for depth in (65, 481, 100_000):
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/sessions/done"):
            r = httpx.post(f"{harness.url}{path}", content=nested(depth), headers=JSON, timeout=30)
            assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"], (depth, path, r.text)
    assert chat(harness, {"model": "m", "messages": [{"role": "user", "content": "x"}]}).status_code == 200


def test_nan_and_infinity_are_a_400_not_a_500(harness):
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"model": "m", "temperature": ' + constant + b', "messages": [{"role": "user", "content": "x"}]}'
        r = httpx.post(f"{harness.url}/v1/chat/completions", content=body, headers=JSON, timeout=30)
        assert r.status_code == 400 and "not a JSON number" in r.json()["error"]["message"], r.text
    assert harness.store.count() == 0


def test_chunked_body_over_the_limit_is_a_413(tmp_path, upstream):
    for h in make_harness(tmp_path, upstream, max_body_bytes=4096):

        def chunks():
            yield b'{"model": "m", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}]}'

        r = httpx.post(f"{h.url}/v1/chat/completions", content=chunks(), headers=JSON, timeout=30)
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        small = b'{"model": "m", "messages": [{"role": "user", "content": "ok"}]}'
        r = httpx.post(f"{h.url}/v1/chat/completions", content=iter([small[:10], small[10:]]), headers=JSON, timeout=30)
        assert r.status_code == 200 and h.store.count() == 1


def test_replies_keep_the_clients_model_id_and_carry_no_extras(harness):
    c = openai.OpenAI(base_url=f"{harness.url}/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    raw = c.chat.completions.with_raw_response.create(model="gpt-5-mini", messages=msgs)
    body = json.loads(raw.text)
    assert body["model"] == "gpt-5-mini" and "adapter_version" not in body
    assert raw.headers["x-metaclaw-adapter-version"] == "0"
    chunks = list(c.chat.completions.create(model="my-agent", messages=msgs, stream=True))
    assert {ch.model for ch in chunks} == {"my-agent"}
    assert all("adapter_version" not in ch.model_dump() for ch in chunks)
    side = c.chat.completions.create(model="title-model", messages=msgs, extra_headers={"X-Turn-Type": "side"})
    assert side.model == "title-model"
    r = httpx.post(f"{harness.url}/v1/messages", json={"model": "claude-opus-4", "max_tokens": 8, "messages": msgs})
    assert r.json()["model"] == "claude-opus-4" and "adapter_version" not in r.json()
    assert len(harness.store.select()) == 3 and harness.store.select()[0].adapter_version == 0


def test_stop_sequence_maps_to_anthropic_stop_reason():
    body = {"id": "x", "choices": [{"message": {"content": "a"}, "finish_reason": "stop", "stop_reason": "END"}]}
    msg = to_anthropic_response(body, "claude")
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")
    body["choices"][0]["stop_reason"] = None
    assert to_anthropic_response(body, "claude")["stop_reason"] == "end_turn"
    conv = AnthropicStream("claude")
    start = json.loads(conv.start(12).split(b"data: ")[1])
    assert start["message"]["usage"]["input_tokens"] == 12
    list(conv.feed({"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop", "stop_reason": "\n\n"}]}, 3))
    *_, delta, _stop = conv.end()
    data = json.loads(delta.split(b"data: ")[1])
    assert data["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}
    assert data["usage"]["output_tokens"] == 3


def test_the_proxy_publishes_request_body_schemas(harness):
    doc = httpx.get(f"{harness.url}/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/sessions/done"):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["type"] == "object"
        assert "400" in op["responses"] and "422" not in op["responses"]


def test_count_tokens_without_a_tokenizer_says_so(harness):
    body = {"model": "c", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{harness.url}/v1/messages/count_tokens", json=body)
    assert r.status_code == 501 and "tokenizer" in r.json()["error"]["message"]
