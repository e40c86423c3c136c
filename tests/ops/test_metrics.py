"""`/metrics` on the proxy: Prometheus text format, the series an operator looks for, moving as traffic flows."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from metaclaw.ops import metrics
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.store import SampleStore, ServedVersions

KEY = "k-metrics-test"


def scrape(url: str, key: str | None = KEY) -> dict[tuple[str, tuple], float]:
    """`{(sample name, sorted labels): value}` of one scrape, parsed by prometheus_client's own parser."""
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(url: str, agent: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **({"X-Agent-Id": agent} if agent else {})}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_proxy_metrics_parse_and_move(tmp_path, upstream):
    store = SampleStore(tmp_path / "samples.sqlite")
    proxy = RolloutProxy(store, upstream.url, base_model="tiny")
    served = ServedVersions()
    unwatch = metrics.watch_loop(metrics.LoopCollector(store, served, 300.0, metrics.AGENTS))
    try:
        with ThreadedServer(create_app(proxy, api_key=KEY)) as srv:
            assert httpx.get(f"{srv.url}/metrics").status_code == 401  # behind the key by default
            before = scrape(srv.url)
            assert chat(srv.url).status_code == 200
            assert chat(srv.url, agent="sk-this-is-not-a-label").status_code == 200
            deadline = time.monotonic() + 10
            while store.count() < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            served.update(3)
            after = scrape(srv.url)
    finally:
        unwatch()
    route = "/v1/chat/completions"
    requests = value(after, "metaclaw_requests_total", server="proxy", route=route, agent="default", code="200")
    assert (
        requests - value(before, "metaclaw_requests_total", server="proxy", route=route, agent="default", code="200")
        == 2
    )  # an unlisted agent is the default profile: no id becomes a label
    assert value(after, "metaclaw_request_duration_seconds_count", server="proxy", route=route, agent="default") >= 2
    assert value(after, "metaclaw_requests_total", server="proxy", route="/metrics", agent="default", code="401") >= 1
    for kind in ("prompt", "completion"):
        grew = value(after, "metaclaw_tokens_total", server="proxy", agent="default", kind=kind) - value(
            before, "metaclaw_tokens_total", server="proxy", agent="default", kind=kind
        )
        assert grew > 0, kind
    assert value(after, "metaclaw_samples", status="pending") == 2
    assert value(after, "metaclaw_served_adapter_version", agent="default") == 3
    assert ("metaclaw_replies_per_minute", ()) in after
    assert not any(KEY in str(k) or "sk-this" in str(k) for k in after)


def test_gate_records_count_decisions_and_rollbacks():
    def got(name, **labels):
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    before = got("metaclaw_gate_decisions_total", agent="default", decision="accepted")
    rolled = got("metaclaw_rollbacks_total", agent="default")
    metrics.count_gate({"agent_id": "default", "decision": "accepted"})
    metrics.count_gate({"agent_id": "default", "decision": "rolled_back"})
    metrics.count_gate({"agent_id": "default", "decision": "<script>"})  # never a free-text label
    assert got("metaclaw_gate_decisions_total", agent="default", decision="accepted") == before + 1
    assert got("metaclaw_rollbacks_total", agent="default") == rolled + 1
    assert got("metaclaw_gate_decisions_total", agent="default", decision="<script>") == 0


def test_agent_labels_are_bounded():
    label = metrics.BoundedLabel(limit=2)
    assert [label(x) for x in ("a", "b", "c", "a", None)] == ["a", "b", "other", "a", "other"]


def test_metrics_open_when_configured(tmp_path, upstream):
    proxy = RolloutProxy(SampleStore(tmp_path / "s.sqlite"), upstream.url, base_model="tiny")
    with ThreadedServer(create_app(proxy, api_key=KEY, metrics_open=True)) as srv:
        assert "metaclaw_requests_total" in {k[0] for k in scrape(srv.url, key=None)}
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401  # only /metrics opened
