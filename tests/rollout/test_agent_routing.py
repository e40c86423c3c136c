"""The proxy's side of many agents (fast, scripted upstream): agent ids, per-agent mode, per-agent adapter."""

from __future__ import annotations

import httpx
import pytest

from metaclaw.agents import AgentProfiles
from tests.rollout.conftest import make_harness

PROFILES = {"default": {"mode": "rl"}, "alice": {"mode": "rl"}, "bob": {"mode": "skills_only"}}


@pytest.fixture
def agents_harness(tmp_path, upstream):
    yield from make_harness(tmp_path, upstream, agents=AgentProfiles(PROFILES), model_refresh_s=0.2)


def _chat(h, agent: str | None = None, body_agent: str | None = None, text: str = "hello there") -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if body_agent is not None:
        body["agent_id"] = body_agent
    headers = {"X-Agent-Id": agent} if agent is not None else {}
    return httpx.post(f"{h.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("bad", ["../etc", "a/b", "_shared", "x" * 65, "a.b", "%2e%2e"])
def test_bad_agent_ids_get_400_naming_the_header(agents_harness, bad):
    r = _chat(agents_harness, agent=bad)
    assert r.status_code == 400 and "X-Agent-Id" in r.json()["error"]["message"]
    assert agents_harness.store.count() == 0


def test_bad_agent_id_in_the_body_gets_400_naming_the_field(agents_harness):
    r = _chat(agents_harness, body_agent="../../x")
    assert r.status_code == 400 and "agent_id" in r.json()["error"]["message"]
    r = _chat(agents_harness, body_agent=7)
    assert r.status_code == 400 and "agent_id" in r.json()["error"]["message"]


def test_agent_id_from_the_body_is_stored_and_not_forwarded(agents_harness):
    assert _chat(agents_harness, body_agent="carol").status_code == 200
    [sample] = agents_harness.store.select()
    assert sample.agent_id == "carol"
    assert "agent_id" not in agents_harness.upstream_state["requests"][-1]


def test_header_wins_over_the_body_field(agents_harness):
    assert _chat(agents_harness, agent="alice", body_agent="carol").status_code == 200
    assert [s.agent_id for s in agents_harness.store.select()] == ["alice"]


def test_skills_only_agent_is_answered_by_the_base_model_and_never_captured(agents_harness):
    h = agents_harness
    h.upstream_state["adapters"].update({"policy": "/p", "policy:alice": "/a"})
    h.proxy.upstream_models |= {"policy", "policy:alice"}
    r = _chat(h, agent="bob")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    sent = h.upstream_state["requests"][-1]
    assert sent["model"] == "tiny" and "logprobs" not in sent  # base model, no capture extras asked for
    assert h.store.count() == 0 and h.proxy.stats["skills_only"] == 1
    assert "x-metaclaw-adapter" not in r.headers


def test_each_agent_is_sent_to_its_own_adapter_once_the_server_lists_it(agents_harness):
    h = agents_harness
    r = _chat(h, agent="alice")
    assert h.upstream_state["requests"][-1]["model"] == "tiny" and "x-metaclaw-adapter" not in r.headers
    h.upstream_state["adapters"].update({"policy": "/p", "policy:alice": "/a"})
    h.proxy.upstream_models |= {"policy", "policy:alice"}  # what the refresh loop reads from /v1/models
    answered = {}
    for agent in ("alice", None, "carol"):
        r = _chat(h, agent=agent)
        answered[agent] = (h.upstream_state["requests"][-1]["model"], r.headers.get("x-metaclaw-adapter"))
    assert answered == {"alice": ("policy:alice",) * 2, None: ("policy",) * 2, "carol": ("policy",) * 2}
    assert {s.agent_id for s in h.store.select()} == {"alice", "default", "carol"}


def test_unlisted_agents_get_the_default_profile():
    profiles = AgentProfiles({"default": {"mode": "skills_only"}, "alice": {"mode": "rl"}})
    assert profiles.resolve("zed") is profiles.default and not profiles.resolve("zed").trains
    assert profiles.resolve("alice").lora_name == "policy:alice" and profiles.adapter_of("zed") == "default"
    with pytest.raises(ValueError, match=r"agents.carl.mode"):
        AgentProfiles({"carl": {"mode": "always"}})
    with pytest.raises(ValueError, match=r"agents\.\.\./x"):
        AgentProfiles({"../x": {"mode": "rl"}})
