"""`data.backlog_policy=pause_capture` through the real proxy: the agent is still answered, capture pauses."""

from __future__ import annotations

import openai

from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.store import SampleStore


def test_paused_capture_still_answers_the_agent(tmp_path, upstream):
    store = SampleStore(tmp_path / "samples.sqlite", capture_limit=2)
    proxy = RolloutProxy(store, upstream.url, base_model="tiny")
    with ThreadedServer(create_app(proxy, api_key=None, max_body_bytes=1 << 20)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        for i in range(4):
            store._backlog_seen = (0, -1.0)  # count afresh for each turn (the count is cached for 0.5 s)
            r = client.chat.completions.create(
                model="metaclaw",
                messages=[{"role": "user", "content": f"hello {i}"}],
                extra_headers={"X-Session-Id": f"s{i}"},
            )
            assert r.choices[0].message.content
    assert store.count() == 2 and store.stats["capture_paused"] == 2
    assert proxy.stats["captured"] == 2
