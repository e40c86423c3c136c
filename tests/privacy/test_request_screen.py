"""Everything a request carries is screened, on the OpenAI, Anthropic and Responses routes (issue 43, finding 1):
a key in a tool's description or a parameter's default, a message `name`, a tool-call id or `chat_template_kwargs`
drops the turn (no token ids kept) and is not in the store's file; tool-call ids themselves are not secrets."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from metaclaw.privacy import PrivacyPolicy
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.store import SampleStore
from tests.privacy.test_policy import file_bytes

KEY = "ghp_" + "Zq7Lm2Xc9Vb4Nn1Kp8Rt5Wy3Hd6Fg0Js2QlA8"
USER = {"role": "user", "content": "List the files, please."}


def fn_tool(description: str = "Run a shell command.", default: str = "ls") -> dict[str, Any]:
    params = {"type": "object", "properties": {"cmd": {"type": "string", "default": default}}}
    return {"type": "function", "function": {"name": "shell", "description": description, "parameters": params}}


def tool_call_turn(call_id: str) -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}
    return [USER, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": "a.txt b.txt"}]  # fmt: skip


CHAT_ATTACKS = {
    "tool_description": {"messages": [USER], "tools": [fn_tool(description=f"Deploys with token {KEY}")]},
    "parameter_default": {"messages": [USER], "tools": [fn_tool(default=KEY)]},
    "message_name": {"messages": [{**USER, "name": KEY}]},
    "tool_call_id": {"messages": tool_call_turn(KEY), "tools": [fn_tool()]},
    "chat_template_kwargs": {"messages": [USER], "chat_template_kwargs": {"note": f"token {KEY}"}},
    "split_across_messages": {
        "messages": [
            {"role": "user", "content": f"my token is {KEY[:20]}"},
            {"role": "user", "content": f"{KEY[20:]} - why is it rejected?"},
        ]
    },
}
ANTHROPIC_TOOL = {"name": "shell", "description": f"uses {KEY}", "input_schema": {"type": "object", "properties": {}}}
RESPONSES_TOOL = {"type": "function", "name": "shell", "description": f"uses {KEY}",
                  "parameters": {"type": "object", "properties": {}}}  # fmt: skip


@pytest.fixture
def screened(tmp_path):
    with ThreadedServer(scripted_upstream()) as upstream:
        yield from _screened(tmp_path, upstream)


def _screened(tmp_path, upstream):
    store = SampleStore(tmp_path / "samples.sqlite", screen=PrivacyPolicy())
    proxy = RolloutProxy(store, upstream.url, base_model="tiny")
    with ThreadedServer(create_app(proxy)) as srv:
        yield store, srv.url
    store.close()


def _only_sample(store: SampleStore):
    rows = store.select("dropped") + store.select("pending")
    assert len(rows) == 1, rows
    return rows[0]


def _assert_screened(store: SampleStore) -> None:
    s = _only_sample(store)
    assert s.status == "dropped" and s.meta["dropped"] == "secret", s.meta
    assert s.prompt_ids == [] and s.response_ids == []  # the ids would decode back to the key
    data = file_bytes(store)
    assert KEY.encode() not in data and KEY[4:24].encode() not in data and KEY[20:].encode() not in data


@pytest.mark.parametrize("attack", sorted(CHAT_ATTACKS))
def test_a_key_anywhere_in_a_chat_request_is_never_stored(screened, attack):
    store, url = screened
    body = {"model": "m", "max_tokens": 4, **CHAT_ATTACKS[attack]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": "s1"}, timeout=30)
    assert r.status_code == 200, r.text
    _assert_screened(store)


def test_a_key_in_anthropic_tools_is_never_stored(screened):
    store, url = screened
    body = {"model": "m", "max_tokens": 4, "messages": [USER], "tools": [ANTHROPIC_TOOL]}
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"X-Session-Id": "s1"}, timeout=30)
    assert r.status_code == 200, r.text
    _assert_screened(store)


def test_a_key_in_responses_tools_is_never_stored(screened):
    store, url = screened
    body = {"model": "m", "max_output_tokens": 4, "input": "List the files, please.", "tools": [RESPONSES_TOOL]}
    r = httpx.post(f"{url}/v1/responses", json=body, headers={"X-Session-Id": "s1"}, timeout=30)
    assert r.status_code == 200, r.text
    _assert_screened(store)


def test_ordinary_tool_call_ids_and_tools_are_kept_and_trained(screened):
    store, url = screened
    body = {"model": "m", "max_tokens": 4, "messages": tool_call_turn("call_Xk3j9QpL2mZ8vR4tY7wB1nC6"),
            "tools": [fn_tool()], "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": "s1"}, timeout=30)
    assert r.status_code == 200, r.text
    s = _only_sample(store)
    assert s.status == "pending" and s.prompt_ids and s.meta["tools"] == [fn_tool()]
