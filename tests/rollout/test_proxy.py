"""The proxy against a scripted upstream: capture, sessions, next state, streaming, stripping, bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.rollout.conftest import make_harness

SYSTEM = {"role": "system", "content": "You are helpful."}


def client(h, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{h.url}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def test_non_streaming_turn_is_captured_with_server_tokens(harness):
    r = client(harness).chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "Sure, here is the answer."
    assert r.choices[0].logprobs is None  # the proxy's own extras are stripped
    assert "prompt_token_ids" not in r.model_dump() and "token_ids" not in r.choices[0].model_dump()
    [s] = harness.store.select()
    assert s.status == "pending" and s.turn_index == 0 and s.session_id.startswith("auto-")
    assert s.prompt_ids[0] == 1 and len(s.response_ids) == len(s.behaviour_logprobs) > 0
    assert s.temperature == 1.0 and s.adapter_version == 0
    assert s.text.messages == [SYSTEM, {"role": "user", "content": "hi"}]
    sent = harness.upstream_state["requests"][-1]
    assert sent["logprobs"] is True and sent["return_token_ids"] is True and sent["temperature"] == 1.0


def test_client_that_asks_for_logprobs_and_ids_keeps_them(harness):
    r = client(harness).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True, extra_body={"return_token_ids": True}
    )
    body = r.model_dump()
    assert body["choices"][0]["logprobs"]["content"] and body["choices"][0]["token_ids"] and body["prompt_token_ids"]


def test_multi_turn_session_without_headers_sets_next_state(harness):
    c = client(harness)
    msgs = [SYSTEM, {"role": "user", "content": "question"}]
    r = c.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "thanks!"}]
    stream = c.chat.completions.create(model="m", messages=msgs, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == "Sure, here is the answer."
    first, second = harness.store.select()
    assert first.session_id == second.session_id and (first.turn_index, second.turn_index) == (0, 1)
    assert first.text.next_state == "thanks!" and second.text.next_state is None
    assert second.response_ids and len(second.behaviour_logprobs) == len(second.response_ids)


REMINDER = "<system-reminder>\nOutput token limit hit. Resume directly.\n</system-reminder>"


def test_an_agents_own_continuation_is_no_reaction_and_the_persons_next_words_answer_the_chain(harness):
    """Claude Code continues a reply cut at max_tokens with a `<system-reminder>` of its own (recorded in
    `make test-agents`): that is not the person's reaction, so the turn waits; the person's next message (behind
    OpenClaw-style timestamp envelopes) is the next state of every turn of the chain."""
    c = client(harness)
    msgs = [SYSTEM, {"role": "user", "content": "[Sat 2026-11-28 18:09 UTC] question"}]
    for follow in (REMINDER, REMINDER, "[Sat 2026-11-28 18:12 UTC] Thanks, that's all for now."):
        r = c.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": follow}]
    c.chat.completions.create(model="m", messages=msgs)
    samples = harness.store.select()
    assert len(samples) == 4 and len({s.session_id for s in samples}) == 1
    assert [s.text.next_state for s in samples] == ["Thanks, that's all for now."] * 3 + [None]


def test_headers_select_session_agent_side_turns_and_done(harness):
    c = client(harness)
    hdr = {"X-Session-Id": "s1", "X-Agent-Id": "agent-a", "X-Turn-Type": "main"}
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], extra_headers=hdr)
    side = {**hdr, "X-Turn-Type": "side"}
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "title?"}], extra_headers=side)
    done = {**hdr, "X-Session-Done": "true"}
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}]
    c.chat.completions.create(model="m", messages=msgs, extra_headers=done, temperature=0.7)
    samples = harness.store.select()
    assert [(s.session_id, s.agent_id, s.turn_index) for s in samples] == [("s1", "agent-a", 0), ("s1", "agent-a", 1)]
    assert samples[0].text.next_state == "b" and samples[1].temperature == 0.7
    assert ("agent-a", "s1") in harness.proxy.sessions.log.done_sessions()


def test_stream_is_stored_before_done_marker(harness):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{harness.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        chunks = []
        for line in r.iter_lines():
            if line == "data: [DONE]":
                assert harness.store.count() == 1  # durable before the client sees the end
                break
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert len(chunks) > 2 and all("token_ids" not in ch["choices"][0] for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_pass_through_and_are_captured(harness, stream):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    kw = dict(model="m", messages=[{"role": "user", "content": "use the tool"}], tools=tools)
    c = client(harness)
    if stream:
        calls = [
            tc
            for ch in c.chat.completions.create(stream=True, **kw)
            if ch.choices
            for tc in ch.choices[0].delta.tool_calls or []
        ]
        assert calls[0].function.name == "get_weather"
    else:
        msg = c.chat.completions.create(**kw).choices[0].message
        assert msg.tool_calls[0].function.name == "get_weather"
    [s] = harness.store.select()
    assert "[tool call]" in s.text.response_text and s.meta["tools"] == tools
    assert s.meta["finish_reason"] == "tool_calls"


def test_openclaw_parts_and_tool_results_are_normalised(harness):
    msgs = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [{"type": "toolCall", "id": "c1", "name": "w", "arguments": {"x": 1}}]},
        {"role": "toolResult", "toolCallId": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    client(harness).chat.completions.create(model="m", messages=msgs)
    sent = harness.upstream_state["requests"][-1]["messages"]
    assert sent[0] == {"role": "system", "content": "Be brief."}
    assert sent[2]["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"x": 1}'}
    assert sent[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_image_turns_answer_with_a_placeholder_and_are_not_trained_on(harness):
    parts = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
    ]
    r = client(harness).chat.completions.create(model="m", messages=[{"role": "user", "content": parts}])
    assert r.choices[0].message.content
    sent = harness.upstream_state["requests"][-1]["messages"][0]["content"]
    assert sent == "what is this\n[image omitted: this model reads text only]"
    [s] = harness.store.select()
    assert s.status == "dropped" and s.meta["dropped"].startswith("image") and s.meta["images"] == "placeholder"


def test_bad_input_gets_4xx_and_the_proxy_keeps_serving(tmp_path, upstream):
    for h in make_harness(tmp_path, upstream, max_body_bytes=4096):
        url = f"{h.url}/v1/chat/completions"
        client(h).chat.completions.create(model="m", messages=[{"role": "user", "content": "keep me"}])
        assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
        assert httpx.post(url, json=[1, 2]).status_code == 400
        assert httpx.post(url, json={"messages": []}).status_code == 400
        assert httpx.post(url, json={"messages": [{"role": "robot", "content": "x"}]}).status_code == 400
        assert (
            httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).status_code
            == 400
        )
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}]}, headers={"X-Turn-Type": "weird"})
        assert r.status_code == 400 and "X-Turn-Type" in r.json()["error"]["message"]
        big = {"messages": [{"role": "user", "content": "x" * 10000}]}
        assert httpx.post(url, json=big).status_code == 413
        r = httpx.post(f"{h.url}/v1/sessions/done", json={"session_id": "nope"})
        assert r.status_code == 404
        assert httpx.post(f"{h.url}/v1/sessions/done", json={}).status_code == 400
        r = client(h).chat.completions.create(model="m", messages=[{"role": "user", "content": "still here"}])
        assert r.choices[0].message.content
        assert h.store.count() == 2 and httpx.get(f"{h.url}/health").json()["status"] == "ok"


def test_done_endpoint_marks_a_known_session(harness):
    client(harness).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], extra_headers={"X-Session-Id": "known"}
    )
    r = httpx.post(f"{harness.url}/v1/sessions/done", json={"session_id": "known"})
    assert r.status_code == 200 and ("default", "known") in harness.proxy.sessions.log.done_sessions()


def test_upstream_errors_are_forwarded(tmp_path, upstream):
    for h in make_harness(tmp_path, upstream, policy_model=None):
        h.proxy.base_model = "no-such-model"
        with pytest.raises(openai.NotFoundError):
            client(h).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert h.store.count() == 0 and h.proxy.stats["upstream_errors"] == 1


def test_api_key_is_required_except_on_health(tmp_path, upstream):
    for h in make_harness(tmp_path, upstream, api_key="s3cret"):
        with pytest.raises(openai.AuthenticationError):
            client(h, api_key="wrong").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert httpx.get(f"{h.url}/health").status_code == 200
        r = client(h, api_key="s3cret").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert r.choices[0].message.content


def test_adapter_version_follows_the_loaded_adapter(harness):
    httpx.post(f"{harness.upstream_url}/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": "/x"})
    import asyncio

    asyncio.run(_refresh(harness))
    r = client(harness).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "x"}]
    )
    assert r.headers["x-metaclaw-adapter-version"] == "1"
    assert harness.upstream_state["requests"][-1]["model"] == "policy"
    assert harness.store.select()[-1].adapter_version == 1


async def _refresh(h) -> None:
    async with httpx.AsyncClient() as c:
        h.proxy.upstream_models = {m["id"] for m in (await c.get(f"{h.upstream_url}/v1/models")).json()["data"]}


class EchoInjector:
    """A trivial skill injector: prepends one fixed skill to the system prompt."""

    def inject(self, messages, agent_id):
        return [{"role": "system", "content": "## Active skills\nbe-brief"}, *messages], ["be-brief"]

    def generation(self, agent_id):
        return 7


def test_skills_are_injected_on_main_turns_and_recorded(tmp_path, upstream):
    for h in make_harness(tmp_path, upstream, skills=EchoInjector()):
        client(h).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        side = {"X-Turn-Type": "side"}
        client(h).chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}], extra_headers=side)
        first, second = h.upstream_state["requests"]
        assert first["messages"][0]["content"].startswith("## Active skills") and len(second["messages"]) == 1
        [s] = h.store.select()
        assert s.meta["skills"] == ["be-brief"] and s.meta["skill_generation"] == 7


def test_concurrent_turns_are_all_stored_before_they_end(harness):
    from concurrent.futures import ThreadPoolExecutor

    def turn(i: int) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "stream": i % 2 == 0}
        with httpx.stream(
            "POST", f"{harness.url}/v1/chat/completions", json=body, headers={"X-Session-Id": f"c{i}"}, timeout=60
        ) as r:
            assert r.status_code == 200
            raw = r.read()
        if body["stream"]:
            assert raw.endswith(b"data: [DONE]\n\n")
        return i

    with ThreadPoolExecutor(16) as pool:
        assert sorted(pool.map(turn, range(32))) == list(range(32))
    samples = harness.store.select()
    assert sorted(s.session_id for s in samples) == sorted(f"c{i}" for i in range(32))
    assert all(len(s.response_ids) == len(s.behaviour_logprobs) > 0 for s in samples)
    writer = harness.proxy.writer.stats
    assert writer["writes"] == 32 and writer["commits"] <= 32 and harness.proxy.stats["captured"] == 32


def test_side_turn_stream_is_passed_through_untouched(harness):
    body = {"model": "m", "messages": [{"role": "user", "content": "title?"}], "stream": True}
    with httpx.stream(
        "POST", f"{harness.url}/v1/chat/completions", json=body, headers={"X-Turn-Type": "side"}, timeout=30
    ) as r:
        raw = r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) > 2
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Sure, here is the answer."
    assert harness.store.count() == 0 and "logprobs" not in harness.upstream_state["requests"][-1]


def test_client_that_keeps_extras_gets_upstream_events_verbatim(harness):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body |= {"logprobs": True, "return_token_ids": True}
    with httpx.stream("POST", f"{harness.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[6:]) for line in lines]
    assert chunks[0]["prompt_token_ids"] and all(c["choices"][0]["token_ids"] for c in chunks)
    [s] = harness.store.select()
    assert s.response_ids == [t for c in chunks for t in c["choices"][0]["token_ids"]]
