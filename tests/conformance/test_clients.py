"""The client quickstarts of docs/clients.md, each run through the proxy in front of the real tiny policy server:
the real `openai` and `anthropic` SDKs as the docs set them up, and, for tools that cannot run here (Claude Code,
Codex, OpenClaw, LangChain, LiteLLM), the requests those tools send, written down with their source. Each checks
that the turn was captured and is claimed by an optimizer step (trained on)."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest

from metaclaw.rollout.conversation import edited, loose
from tests.conformance.conftest import PROXY_KEY
from tests.conformance.fixtures import OPENCLAW_HISTORY, TOOLS


@pytest.fixture(scope="module")
def oa(rig) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{rig.url}/v1", api_key=PROXY_KEY, max_retries=0, timeout=120)


def trained_turn(rig, before: int):
    """The one turn captured since `before` samples, after it was scored and claimed by an optimizer step."""
    samples = rig.store.select()
    assert len(samples) == before + 1, [s.meta.get("response_id") for s in samples[before:]]
    s = samples[-1]
    assert s.status == "pending" and s.response_ids and len(s.behaviour_logprobs) == len(s.response_ids)
    rig.store.set_score(s.id, reward=1.0)
    claimed = rig.store.claim_batch(step=10_000 + s.id, max_samples=256)
    assert s.id in {c.id for c in claimed}
    return s


def sse_events(text: str) -> list[tuple[str | None, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = "\n".join(ln[6:] for ln in lines if ln.startswith("data: "))
        if data and data != "[DONE]":
            out.append((name, json.loads(data)))
    return out


# ---- the SDKs, as docs/clients.md sets them up -----------------------------------------------------------------


def test_openai_sdk_chat(rig, oa):
    n = rig.store.count()
    r = oa.chat.completions.create(model="metaclaw", messages=[{"role": "user", "content": "Hello!"}], max_tokens=6)
    s = trained_turn(rig, n)
    assert r.id == s.meta["response_id"] and r.model == "metaclaw"


def test_openai_sdk_responses_plain_and_streamed(rig, oa):
    n = rig.store.count()
    r = oa.responses.create(model="metaclaw", instructions="Be brief.", input="Hello!", max_output_tokens=6)
    s = trained_turn(rig, n)
    assert r.id == s.meta["response_id"] and r.usage.output_tokens == len(s.response_ids)
    assert r.usage.input_tokens == len(s.prompt_ids) and s.text.messages[0] == {
        "role": "system",
        "content": "Be brief.",
    }
    n = rig.store.count()
    events = list(oa.responses.create(model="metaclaw", input="Count to three.", max_output_tokens=6, stream=True))
    s = trained_turn(rig, n)
    final = events[-1].response
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert final.id == s.meta["response_id"] and final.usage.output_tokens == len(s.response_ids)


def test_anthropic_sdk_with_key_and_with_auth_token(rig):
    kw = {"base_url": rig.url, "max_retries": 0, "timeout": 120}
    for client in (anthropic.Anthropic(api_key=PROXY_KEY, **kw), anthropic.Anthropic(auth_token=PROXY_KEY, **kw)):
        n = rig.store.count()
        msg = client.messages.create(model="claude-sonnet-4-5", max_tokens=6,
                                     messages=[{"role": "user", "content": "Hello!"}])  # fmt: skip
        s = trained_turn(rig, n)
        assert msg.usage.output_tokens == len(s.response_ids)


def test_models_retrieve_and_legacy_completions_pass_through_uncaptured(rig, oa):
    assert oa.models.retrieve("metaclaw").id == "metaclaw"
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-4o")
    n = rig.store.count()
    r = oa.completions.create(model="gpt-3.5-turbo-instruct", prompt="Once upon a time", max_tokens=4)
    assert r.model == "gpt-3.5-turbo-instruct" and r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:  # our server does not stream completions (vLLM does: passed on)
        oa.completions.create(model="m", prompt="Once upon a time", max_tokens=4, stream=True)
    assert "stream" in e.value.message and e.value.code is None
    assert rig.store.count() == n  # a raw prompt has no conversation: passed through, never captured
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="m", prompt={"not": "a prompt"}, max_tokens=4)
    assert "prompt" in e.value.message


# ---- tools that cannot run here: the requests they send ------------------------------------------------------

# Claude Code with ANTHROPIC_BASE_URL + ANTHROPIC_AUTH_TOKEN (sent as `Authorization: Bearer`): a streamed Messages
# request to `/v1/messages?beta=true` with its beta header, a system prompt and turns as text blocks carrying
# `cache_control`, tools with `input_schema`, `metadata.user_id`. Shape as recorded from Claude Code's traffic in
# Anthropic's LLM-gateway docs (docs.anthropic.com/en/docs/claude-code/llm-gateway) and proxies that log it
# (e.g. LiteLLM's Claude Code tutorial); `max_tokens` is 32000 there, 8 here to keep the test fast.
CLAUDE_CODE_HEADERS = {"anthropic-version": "2023-06-01",
                       "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14", "x-app": "cli",
                       "user-agent": "claude-cli/2.0.0 (external, cli)", "Authorization": f"Bearer {PROXY_KEY}",
                       "content-type": "application/json"}  # fmt: skip
CLAUDE_CODE_BODY = {
    "model": "claude-sonnet-4-5-20250929", "max_tokens": 8, "stream": True, "temperature": 1,
    "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nThe working directory is /home/me/project.\n</system-reminder>"},
        {"type": "text", "text": "list the files here", "cache_control": {"type": "ephemeral"}}]}],
    "tools": [{"name": "Bash", "description": "Executes a given bash command",
               "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                                 "timeout": {"type": "number"}},
                                "required": ["command"], "additionalProperties": False,
                                "$schema": "http://json-schema.org/draft-07/schema#"}}],
    "metadata": {"user_id": "user_0f3a_account__session_6a1e0c2b-7c1b-4d2e-9d1a-3b3c5f0e9a11"},
}  # fmt: skip


def test_claude_code_request(rig):
    n = rig.store.count()
    r = httpx.post(f"{rig.url}/v1/messages?beta=true", headers=CLAUDE_CODE_HEADERS, json=CLAUDE_CODE_BODY,
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    names = [name for name, _ in sse_events(r.text)]
    assert names[0] == "message_start" and names[-1] == "message_stop" and "error" not in names
    s = trained_turn(rig, n)
    assert s.meta["tools"][0]["function"]["name"] == "Bash"


# Codex with `wire_api = "responses"`: a streamed `/v1/responses` request, the whole conversation in `input`
# (`store: false`, never `previous_response_id`), flat function tools, `tool_choice: "auto"`, its `originator` and
# session headers. Fields from `ResponsesApiRequest` in openai/codex `codex-rs/codex-api/src/common.rs` (model,
# instructions, input, tools, tool_choice, parallel_tool_calls, reasoning, store, stream, include,
# prompt_cache_key); the second request adds the `function_call` and `function_call_output` items Codex sends
# after running the shell tool (`ResponseItem` in `codex-rs/protocol/src/models.rs`).
SHELL_TOOL = {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
              "strict": False, "parameters": {"type": "object", "required": ["command"], "properties": {
                  "command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"},
                  "timeout_ms": {"type": "number"}}, "additionalProperties": False}}  # fmt: skip


def codex_body(input_items: list[dict], thread: str) -> dict:
    return {"model": "metaclaw", "instructions": "You are Codex, a coding agent. Be concise.", "input": input_items,
            "tools": [SHELL_TOOL], "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": None,
            "store": False, "stream": True, "include": [], "prompt_cache_key": thread}  # fmt: skip


def test_codex_requests(rig):
    thread = str(uuid.uuid4())
    headers = {"Authorization": f"Bearer {PROXY_KEY}", "OpenAI-Beta": "responses=experimental",
               "originator": "codex_cli_rs", "session_id": thread, "conversation_id": thread,
               "accept": "text/event-stream"}  # fmt: skip
    env = "<environment_context>\n  <cwd>/home/me/project</cwd>\n</environment_context>"
    ask = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
           for text in (env, "What is in README.md?")]  # fmt: skip
    n = rig.store.count()
    r = httpx.post(f"{rig.url}/v1/responses", headers=headers, json=codex_body(ask, thread), timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = sse_events(r.text)
    assert [e for e, _ in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1][0] in ("response.completed", "response.incomplete") and all(e == d["type"] for e, d in events)
    first = trained_turn(rig, n)
    assert first.meta["response_id"] == events[-1][1]["response"]["id"]
    ran = [{"type": "function_call", "name": "shell", "arguments": '{"command": ["cat", "README.md"]}',
            "call_id": "call_k2"},
           {"type": "function_call_output", "call_id": "call_k2", "output": "# Project\nA readme."}]  # fmt: skip
    previous = events[-1][1]["response"]["output"]  # Codex sends its items back
    replay = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": c["text"]}]}
              for o in previous if o["type"] == "message" for c in o["content"]]  # fmt: skip
    n = rig.store.count()
    r = httpx.post(f"{rig.url}/v1/responses", headers=headers, json=codex_body(ask + replay + ran, thread), timeout=120)
    assert r.status_code == 200 and sse_events(r.text)[-1][0] in ("response.completed", "response.incomplete")
    second = trained_turn(rig, n)
    assert {"role": "tool", "tool_call_id": "call_k2", "content": "# Project\nA readme."} in second.text.messages
    own_call = any(o["type"] not in ("message", "reasoning") for o in previous)  # this replay sends its text only
    got = " ".join(c["text"] for r in replay for c in r["content"])
    call = {"function": {"name": ran[0]["name"], "arguments": ran[0]["arguments"]}}
    sent = {"role": "assistant", "content": got, "tool_calls": [call]}
    if own_call or not edited(loose({"role": "assistant", "content": got}), loose(sent)):
        # the random tiny model replied no text, made a call of its own (which this replay leaves out), or a reply
        # so short that the call this test adds to it more than doubles it: what is sent back is not the reply it
        # got (not a light edit of it), and an empty reply continues no session (docs/security.md): a new session,
        # by design
        assert second.session_id != first.session_id
        return
    assert second.session_id == first.session_id and second.turn_index == first.turn_index + 1


# OpenClaw with a custom provider (`models.providers.<id>` with `api: "openai-completions"`, `baseUrl`, `apiKey`):
# streamed OpenAI chat completions with usage, its tools and its list-of-parts transcript (tests/conformance/
# fixtures.py, written from OpenClaw's docs and session files).
def test_openclaw_request(rig, oa):
    n = rig.store.count()
    chunks = list(oa.chat.completions.create(model="metaclaw", messages=OPENCLAW_HISTORY, tools=TOOLS, max_tokens=6,
                                             stream=True, stream_options={"include_usage": True}))  # fmt: skip
    s = trained_turn(rig, n)
    assert chunks[-1].usage.completion_tokens == len(s.response_ids)


# LangChain's `ChatOpenAI(base_url=..., api_key=..., model=...)` calls the openai SDK's
# `client.chat.completions.with_raw_response.create(messages=..., model=..., stream=False)`; `.stream()` adds
# `stream=True, stream_options={"include_usage": True}` (langchain_openai/chat_models/base.py: `_get_request_payload`,
# `stream_usage`). LiteLLM's `completion(model="openai/metaclaw", api_base=..., api_key=...)` strips the
# `openai/` prefix and calls the same SDK method (litellm/llms/openai/openai.py). Not installed here (heavy).
@pytest.mark.parametrize("client", ["langchain", "langchain-stream", "litellm"])
def test_langchain_and_litellm_requests(rig, oa, client):
    n = rig.store.count()
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi there"}]
    if client == "langchain-stream":
        usage = {"include_usage": True}
        raw = oa.chat.completions.with_raw_response.create(model="metaclaw", messages=messages, stream=True,
                                                           stream_options=usage, max_tokens=6)  # fmt: skip
        chunks = list(raw.parse())
        assert chunks[-1].usage is not None
    else:
        raw = oa.chat.completions.with_raw_response.create(model="metaclaw", messages=messages, max_tokens=6,
                                                           stream=False)  # fmt: skip
        assert raw.parse().choices[0].message.role == "assistant"
    s = trained_turn(rig, n)
    assert s.text.messages[-1] == {"role": "user", "content": "Hi there"}
