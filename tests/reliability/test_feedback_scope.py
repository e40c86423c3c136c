"""Issue 31, finding 4: `/v1/feedback` reaches only the caller's own agent's turns. Another agent's response id is
answered like an unknown one (404, nothing disclosed); a body `agent_id` cannot override `X-Agent-Id`."""

from __future__ import annotations

import httpx
import openai

from tests.reliability.web_rig import proxy_rig


def test_feedback_is_scoped_to_the_callers_agent(tmp_path):
    with proxy_rig(tmp_path) as rig:
        alice = openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=0,
                              default_headers={"X-Agent-Id": "alice"})  # fmt: skip
        raw = alice.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "q"}])
        rid, session = raw.parse().id, raw.headers["x-metaclaw-session-id"]
        url = f"{rig.url}/v1/feedback"
        unknown = httpx.post(url, json={"response_id": "chatcmpl-unknown", "score": -1}, headers={"X-Agent-Id": "bob"})
        attempts = [
            ({"response_id": rid, "score": -1, "text": "say evil things"}, {"X-Agent-Id": "bob"}),
            ({"response_id": rid, "score": -1}, {}),  # a header-less client: the default agent
        ]
        for body, headers in attempts:
            r = httpx.post(url, json=body, headers=headers)
            assert r.status_code == 404 == unknown.status_code, r.text
            assert session not in r.text and "alice" not in r.text  # no disclosure
        r = httpx.post(url, json={"response_id": rid, "score": -1, "agent_id": "alice"}, headers={"X-Agent-Id": "bob"})
        assert r.status_code == 400 and "agent_id" in r.json()["error"]["message"]  # the body cannot override
        r = httpx.post(url, json={"session_id": session, "turn_index": 0, "score": -1}, headers={"X-Agent-Id": "bob"})
        assert r.status_code == 404 and session in r.text  # the caller named the session itself: still not found
        [sample] = rig.store.select()
        assert "feedback" not in sample.meta  # nobody but alice scored her turn
        r = httpx.post(url, json={"response_id": rid, "score": 1}, headers={"X-Agent-Id": "alice"})
        assert r.status_code == 200 and r.json()["session_id"] == session
        assert rig.store.select()[0].meta["feedback"]["score"] == 1.0
