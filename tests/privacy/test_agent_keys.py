"""Per-agent keys (`rollout.proxy.agent_keys`): a key holder is pinned to its agent, cannot reach the control
routes, and cannot touch another agent's turns; the owner's key keeps full access. Real proxy on 127.0.0.1,
the real `openai` SDK, a scripted upstream."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from metaclaw.agents import AgentProfiles
from metaclaw.privacy.access import AgentKeyMiddleware, check_agent_keys
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.store import SampleStore

OWNER, ALICE_KEY, BOB_KEY = "owner-key-0123456789", "alice-key-0123456789", "bob-key-0123456789ab"


@pytest.fixture
def proxy(tmp_path):
    store = SampleStore(tmp_path / "samples.sqlite")
    keys = check_agent_keys({ALICE_KEY: "alice", BOB_KEY: "bob"}, OWNER)
    with ThreadedServer(scripted_upstream()) as upstream:
        app = create_app(RolloutProxy(store, upstream.url, base_model="tiny"), api_key=OWNER)
        with ThreadedServer(AgentKeyMiddleware(app, OWNER, keys, store)) as srv:
            yield srv.url, store


def ask(url: str, key: str, **headers: str):
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    return c.chat.completions.with_raw_response.create(model="metaclaw", messages=messages, extra_headers=headers)


def test_an_agent_key_is_pinned_to_its_agent(proxy):
    url, store = proxy
    r = ask(url, ALICE_KEY, **{"X-Session-Id": "s1"})  # no X-Agent-Id: filed as alice's
    assert [s.agent_id for s in store.select()] == ["alice"]
    with pytest.raises(openai.PermissionDeniedError, match="agent 'alice'"):
        ask(url, ALICE_KEY, **{"X-Agent-Id": "bob"})
    rid = r.headers["x-metaclaw-response-id"]
    fb = {"response_id": rid, "score": 1.0}
    assert httpx.post(f"{url}/v1/feedback", json=fb, headers={"Authorization": f"Bearer {BOB_KEY}"}).status_code == 404
    assert httpx.post(f"{url}/v1/feedback", json={**fb, "agent_id": "alice"},
                      headers={"Authorization": f"Bearer {BOB_KEY}"}).status_code == 403  # fmt: skip
    assert "feedback" not in store.select()[0].meta  # bob could not touch alice's turn
    ok = httpx.post(f"{url}/v1/feedback", json=fb, headers={"Authorization": f"Bearer {ALICE_KEY}"})
    assert ok.status_code == 200 and ok.json()["agent_id"] == "alice"
    for path in ("/control/status", "/dashboard"):
        assert httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {ALICE_KEY}"}).status_code == 403
    ask(url, OWNER, **{"X-Agent-Id": "bob", "X-Session-Id": "s2"})  # the owner: any agent
    assert sorted(s.agent_id for s in store.select()) == ["alice", "bob"]
    with pytest.raises(openai.AuthenticationError):
        ask(url, "not-a-key-0123456789")


def test_agent_keys_are_checked_where_the_config_is_built():
    with pytest.raises(ValueError, match="needs rollout.proxy.api_key"):
        check_agent_keys({ALICE_KEY: "alice"}, None)
    with pytest.raises(ValueError, match="at least 16"):
        check_agent_keys({"short": "alice"}, OWNER)
    with pytest.raises(ValueError, match="equals"):
        check_agent_keys({OWNER: "alice"}, OWNER)
    with pytest.raises(ValueError):
        check_agent_keys({ALICE_KEY: "../etc"}, OWNER)


def test_an_agent_key_refused_on_anthropic_routes_gets_anthropic_shape(proxy):
    url, _ = proxy
    client = anthropic.Anthropic(base_url=url, api_key=ALICE_KEY, max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError) as e:
        client.messages.create(model="c", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               extra_headers={"X-Agent-Id": "bob"})  # fmt: skip
    error = {"type": "permission_error", "message": "this key is for agent 'alice', not 'bob'"}
    assert e.value.body == {"type": "error", "error": error}


def test_an_agent_key_is_answered_by_its_own_adapter_on_legacy_completions(tmp_path):
    """Issue 43 (finding 4): `/v1/completions` with Alice's key is served by Alice's adapter, never the shared one
    (whose prompt logprobs would score any text against other agents' data)."""
    store = SampleStore(tmp_path / "samples.sqlite")
    keys = check_agent_keys({ALICE_KEY: "alice"}, OWNER)
    agents = AgentProfiles({"alice": {"mode": "rl"}}, "policy")
    with ThreadedServer(scripted_upstream()) as upstream:
        for name in ("policy", "policy:alice"):
            httpx.post(f"{upstream.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/x"})
        proxy = RolloutProxy(store, upstream.url, base_model="tiny", policy_model="policy", agents=agents)
        with ThreadedServer(AgentKeyMiddleware(create_app(proxy, api_key=OWNER), OWNER, keys, store)) as srv:
            body = {"model": "metaclaw", "prompt": [1, 2, 3], "max_tokens": 1, "echo": True, "logprobs": 1,
                    "agent_id": "default"}  # fmt: skip
            r = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {ALICE_KEY}"})
            assert r.status_code == 200, r.text
            r = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {OWNER}"})
            assert r.status_code == 200, r.text
        seen = [c["model"] for c in upstream.server.config.app.state.scripted["completions"]]
    assert seen == ["policy:alice", "policy"]
    store.close()


def test_explicit_session_ids_are_partitioned_by_key(tmp_path):
    """Issue 43 (finding 8): a second key of the same agent that knows a session id writes into, and ends, a session
    of its own, never the first key's; the first key's session keeps its own next state."""
    store = SampleStore(tmp_path / "samples.sqlite")
    phone = "alice-phone-0123456789"
    keys = check_agent_keys({ALICE_KEY: "alice", phone: "alice"}, OWNER)
    with ThreadedServer(scripted_upstream()) as upstream:
        app_proxy = RolloutProxy(store, upstream.url, base_model="tiny")
        app = create_app(app_proxy, api_key=OWNER)
        with ThreadedServer(AgentKeyMiddleware(app, OWNER, keys, store)) as srv:
            first = ask(srv.url, ALICE_KEY, **{"X-Session-Id": "s1"})
            mine = first.headers["x-metaclaw-session-id"]
            other = ask(srv.url, phone, **{"X-Session-Id": "s1", "X-Metaclaw-Client": "forged"})
            assert other.headers["x-metaclaw-session-id"] != mine
            done = httpx.post(f"{srv.url}/v1/sessions/done", json={"session_id": "s1"},
                              headers={"Authorization": f"Bearer {phone}"})  # fmt: skip
            assert done.status_code == 200 and done.json()["session_id"] != mine
            assert ("alice", mine) not in app_proxy.sessions.log.done_sessions()
            again = ask(srv.url, ALICE_KEY, **{"X-Session-Id": mine})  # the id it was given back works too
            assert again.headers["x-metaclaw-session-id"] == mine
    by_session: dict[str, int] = {}
    for s in store.select():
        by_session[s.session_id] = by_session.get(s.session_id, 0) + 1
    assert by_session[mine] == 2 and len(by_session) == 2
    store.close()
