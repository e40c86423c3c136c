"""The official `anthropic` SDK drives the proxy in front of the real tiny policy server: messages (plain,
streamed, with tools, tool results and images), real usage counts, `count_tokens`, stop sequences, errors."""

from __future__ import annotations

import anthropic
import pytest

from tests.conformance.conftest import PROXY_KEY
from tests.conformance.fixtures import PNG

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
HISTORY = [
    {"role": "user", "content": "What's the weather in Paris and Rome?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Two calls.", "signature": "sig"},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C sunny"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "22C cloudy"}]},
        {"type": "text", "text": "Compare them."},
    ]},
]  # fmt: skip


@pytest.fixture(scope="module")
def client(rig) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=rig.url, api_key=PROXY_KEY, max_retries=0, timeout=120)


def test_messages_with_tools_results_and_parallel_tool_use(rig, client):
    n = rig.store.count()
    msg = client.messages.create(model="claude-sonnet-4-5", max_tokens=8, system="Be brief.", tools=TOOLS,
                                 messages=HISTORY)  # fmt: skip
    assert isinstance(msg, anthropic.types.Message) and msg.model == "claude-sonnet-4-5"
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    [s] = rig.store.select()[n:]
    assert s.status == "pending" and [m["role"] for m in s.text.messages] == ["system", "user", "assistant", "tool",
                                                                         "tool", "user"]  # fmt: skip
    assert msg.usage.input_tokens == len(s.prompt_ids) and msg.usage.output_tokens == len(s.response_ids)


def test_streaming_usage_carries_real_counts(rig, client):
    n = rig.store.count()
    with client.messages.stream(model="claude-haiku", max_tokens=6,
                                messages=[{"role": "user", "content": "Say hi."}]) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    [s] = rig.store.select()[n:]
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == len(s.prompt_ids) > 0
    assert final.usage.input_tokens == len(s.prompt_ids) and final.usage.output_tokens == len(s.response_ids) > 0
    assert final.model == "claude-haiku"


def test_count_tokens_matches_what_the_server_renders(rig, client):
    counted = client.messages.count_tokens(model="claude", system="Be brief.", tools=TOOLS, messages=HISTORY)
    n = rig.store.count()
    client.messages.create(model="claude", max_tokens=2, system="Be brief.", tools=TOOLS, messages=HISTORY)
    assert counted.input_tokens == len(rig.store.select()[n].prompt_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_is_reported(rig, client, stream):
    msgs = [{"role": "user", "content": "Write a sentence about mountains."}]
    greedy = {"extra_body": {"temperature": 0}}  # this SDK version has no temperature argument
    free = client.messages.create(model="c", max_tokens=16, messages=msgs, **greedy)
    text = free.content[0].text if free.content else ""
    stop = next((text[i : i + 2] for i in range(len(text) // 3, len(text) - 2) if text[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"the tiny model's greedy reply has no usable stop string: {text!r}")
    kw = dict(model="c", max_tokens=16, messages=msgs, stop_sequences=[stop], **greedy)
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert stop not in msg.content[0].text and text.startswith(msg.content[0].text)


def test_image_block_answers_and_is_recorded_not_trainable(rig, client):
    n = rig.store.count()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    msg = client.messages.create(model="c", max_tokens=4, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}])  # fmt: skip
    assert msg.role == "assistant"
    [s] = rig.store.select()[n:]
    assert s.status == "dropped" and s.meta["dropped"].startswith("image")


def test_bad_requests_raise_the_sdks_bad_request_error(rig, client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="c", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}]}])  # fmt: skip
    assert "source" in str(err.value)
    assert client.messages.create(model="c", max_tokens=2, messages=[{"role": "user", "content": "ok"}]).content
