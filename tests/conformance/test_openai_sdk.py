"""The official `openai` SDK drives the proxy in front of the real tiny policy server: every documented shape
answers, the SDK parses the reply, and the turn is captured (or recorded as not trainable, with the reason)."""

from __future__ import annotations

import copy

import httpx
import openai
import pytest

from tests.conformance.conftest import PROXY_KEY
from tests.conformance.fixtures import AGENT_HISTORY, OPENCLAW_HISTORY, PNG, TOOLS, workspace_system_prompt


@pytest.fixture(scope="module")
def client(rig) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{rig.url}/v1", api_key=PROXY_KEY, max_retries=0, timeout=120)


def assert_captured(rig, before: int):
    samples = rig.store.select()
    assert len(samples) == before + 1
    s = samples[-1]
    assert s.status == "pending" and s.response_ids and len(s.behaviour_logprobs) == len(s.response_ids)
    return s


def test_tools_tool_results_parallel_calls_developer_and_reasoning(rig, client):
    n = rig.store.count()
    r = client.chat.completions.create(model="gpt-agent", messages=AGENT_HISTORY, tools=TOOLS, max_tokens=8)
    assert isinstance(r, openai.types.chat.ChatCompletion) and r.model == "gpt-agent"
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    s = assert_captured(rig, n)
    assert s.text.messages[0] == {"role": "system", "content": AGENT_HISTORY[0]["content"]}
    assert [c["id"] for c in s.text.messages[2]["tool_calls"]] == ["call_a", "call_b"]
    assert [m["tool_call_id"] for m in s.text.messages[3:5]] == ["call_a", "call_b"]
    assert s.meta["tools"][1]["function"]["parameters"]["properties"]["mode"]["enum"] == ["sync", "background"]
    # what the model saw is what training sees: the prompt ids are the chat template of the stored messages
    rendered = rig.tokenizer.apply_chat_template(s.text.messages, tools=s.meta["tools"], add_generation_prompt=True)
    assert s.prompt_ids == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_openclaw_parts_thinking_and_tool_result_role(rig, client):
    n = rig.store.count()
    r = client.chat.completions.create(model="openclaw", messages=OPENCLAW_HISTORY, max_tokens=6)
    assert r.choices[0].message.role == "assistant"
    s = assert_captured(rig, n)
    assert s.text.messages[2]["tool_calls"][0]["function"] == {"name": "exec", "arguments": '{"command": "ls notes"}'}
    assert s.text.messages[3] == {"role": "tool", "tool_call_id": "tc1", "content": "a.md\nb.md"}


def test_streaming_with_include_usage(rig, client):
    n = rig.store.count()
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    usage = chunks[-1].usage
    s = assert_captured(rig, n)
    assert usage.prompt_tokens == len(s.prompt_ids) and usage.completion_tokens == len(s.response_ids)
    assert {c.model for c in chunks} == {"m"}


def test_n_and_max_completion_tokens(rig, client):
    n = rig.store.count()
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Two ideas?"}], n=2, max_completion_tokens=3
    )
    assert len(r.choices) == 2 and r.usage.completion_tokens <= 6
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    s = assert_captured(rig, n)  # the first choice is the sample
    assert len(s.response_ids) <= 3


def test_stop_sequences(rig, client):
    msgs = [{"role": "user", "content": "Write a sentence about rivers."}]
    free = client.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0)
    text = free.choices[0].message.content
    stop = next((text[i : i + 2] for i in range(len(text) // 3, len(text) - 2) if text[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"the tiny model's greedy reply has no usable stop string: {text!r}")
    n = rig.store.count()
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content
    assert text.startswith(r.choices[0].message.content)
    assert_captured(rig, n)


def test_response_format_is_passed_through(rig, client):
    n = rig.store.count()
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "JSON please"}], max_tokens=4,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert r.choices[0].message is not None
    assert_captured(rig, n)


def test_image_turn_answers_and_is_recorded_not_trainable(rig, client):
    n = rig.store.count()
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]  # fmt: skip
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=4)
    assert r.choices[0].message.role == "assistant"
    openclaw = [{"role": "user", "content": [{"type": "text", "text": "And this?"},
                                             {"type": "image", "data": PNG, "mimeType": "image/png"}]}]  # fmt: skip
    client.chat.completions.create(model="m", messages=openclaw, max_tokens=4)
    samples = rig.store.select()[n:]
    assert [s.status for s in samples] == ["dropped", "dropped"]
    assert all(s.meta["dropped"].startswith("image") and s.meta["images"] == "placeholder" for s in samples)
    assert "[image omitted" in samples[0].text.messages[0]["content"]


def test_huge_openclaw_system_prompt_is_fitted_and_trained_as_seen(rig, client):
    big = workspace_system_prompt()
    history = copy.deepcopy(AGENT_HISTORY)
    history[0] = {"role": "developer", "content": big}
    history[3]["content"] = "x " * 3000  # a long old tool result: elided first
    n = rig.store.count()
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=8)
    assert r.choices[0].message.role == "assistant"
    s = assert_captured(rig, n)
    ctx = s.meta["context"]
    assert ctx["action"] == "truncated" and ctx["limit"] == 1024 and ctx["prompt_tokens_before"] > 1024
    assert ctx["tool_results_elided"] >= 1 and ctx["system_trimmed_tokens"] > 0
    assert len(s.prompt_ids) == ctx["prompt_tokens_after"] <= ctx["budget"]
    assert s.text.messages[0]["role"] == "system" and s.text.messages[0]["content"].startswith("You are OpenClaw")
    assert s.text.messages[-1] == {"role": "user", "content": "Summarise both."}
    rendered = rig.tokenizer.apply_chat_template(s.text.messages, tools=s.meta["tools"], add_generation_prompt=True)
    assert s.prompt_ids == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_context_policy_off_is_todays_400(rig, client):
    rig.proxy.fit.context.mode = "off"
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="m", messages=[{"role": "system", "content": workspace_system_prompt()},
                                     {"role": "user", "content": "hi"}], max_tokens=4)  # fmt: skip
        assert "context" in str(err.value)
    finally:
        rig.proxy.fit.context.mode = "truncate"


def test_policy_server_rejects_deep_json_with_400(rig):
    deep = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 481 + b"]" * 481 + b"}"
    headers = {"Authorization": f"Bearer {rig.server_key}", "content-type": "application/json"}
    r = httpx.post(f"{rig.server_url}/v1/chat/completions", content=deep, headers=headers, timeout=60)
    assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"]
    headers["Authorization"] = f"Bearer {PROXY_KEY}"
    r = httpx.post(f"{rig.url}/v1/chat/completions", content=deep, headers=headers, timeout=60)
    assert r.status_code == 400
