"""Anthropic `/v1/messages` through the proxy: request conversion, rebuilt responses and events, capture."""

from __future__ import annotations

import json

import httpx

from metaclaw.rollout.anthropic import to_openai_request

TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}]


def test_request_conversion_handles_blocks_tools_and_results():
    body = {
        "model": "claude",
        "max_tokens": 64,
        "system": "Be brief.",
        "tools": TOOLS,
        "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
    }
    out = to_openai_request(body)
    assert out["messages"][0] == {"role": "system", "content": "Be brief."}
    assert out["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert out["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert out["messages"][4] == {"role": "user", "content": "thanks"} and out["stop"] == ["END"]


def test_messages_non_streaming_with_tool_use(harness):
    body = {
        "model": "claude",
        "max_tokens": 32,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "use the tool"}],
    }
    r = httpx.post(f"{harness.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == 200
    msg = r.json()
    assert msg["type"] == "message" and msg["stop_reason"] == "tool_use"
    assert msg["content"][0]["type"] == "tool_use" and msg["content"][0]["input"] == {"city": "Berlin"}
    sent = harness.upstream_state["requests"][-1]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert harness.store.count() == 1


def test_messages_streaming_events(harness):
    body = {"model": "claude", "max_tokens": 32, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    events, text = [], []
    with httpx.stream("POST", f"{harness.url}/v1/messages", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if data["type"] == "content_block_delta":
                    text.append(data["delta"]["text"])
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert "".join(text) == "Sure, here is the answer." and harness.store.count() == 1


def test_messages_bad_request(harness):
    r = httpx.post(f"{harness.url}/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
