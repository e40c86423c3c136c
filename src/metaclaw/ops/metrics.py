"""Prometheus metrics: `GET /metrics` on the rollout proxy and on the policy server (docs/operate.md, "Metrics").

One registry per process (`REGISTRY`). The proxy runs inside the training process, so its `/metrics` also carries
the trainer's series (steps, samples by status, pace, sample age, trainer lag, gate decisions, served versions);
the policy server's carries its own requests and tokens. Labels are bounded: a route is one of the server's own
paths (else `other`), an agent is a configured profile or one of the first `MAX_AGENTS` adapter names seen (else
`other`), a status is an HTTP code. Keys, prompts and replies never appear in a label.

`/metrics` is behind the server's key like every route but `/health` (LiteLLM's choice for a keyed proxy;
vLLM leaves it open): `rollout.proxy.metrics_open=true` / `serve.metrics_open=true` open it for a scraper
without the key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_AGENTS = 64  # distinct agent label values per process; more are counted as `other`
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)  # resident memory, CPU seconds, open files: what an operator checks first
PlatformCollector(registry=REGISTRY)

REQUESTS = Counter("metaclaw_requests", "HTTP requests answered, by server, route, agent and status code",
                   ["server", "route", "agent", "code"], registry=REGISTRY)  # fmt: skip
LATENCY = Histogram("metaclaw_request_duration_seconds", "Time from request to the last byte of the response",
                    ["server", "route", "agent"], buckets=LATENCY_BUCKETS, registry=REGISTRY)  # fmt: skip
TOKENS = Counter("metaclaw_tokens", "Tokens of the turns answered (kind: prompt | completion)",
                 ["server", "agent", "kind"], registry=REGISTRY)  # fmt: skip
STEPS = Counter("metaclaw_train_steps", "Optimizer steps taken by this process", registry=REGISTRY)
GATE = Counter("metaclaw_gate_decisions", "Publish-gate and regression-watch decisions (gate.jsonl), by agent",
               ["agent", "decision"], registry=REGISTRY)  # fmt: skip
ROLLBACKS = Counter("metaclaw_rollbacks", "Served adapters rolled back by the regression watch", ["agent"],
                    registry=REGISTRY)  # fmt: skip


class BoundedLabel:
    """Label values that stay few: the first `limit` distinct values are kept, later ones read `other`."""

    def __init__(self, limit: int = MAX_AGENTS) -> None:
        self.limit, self.seen, self._lock = limit, set[str](), threading.Lock()

    def __call__(self, value: str | None) -> str:
        value = value or "default"
        with self._lock:
            if value in self.seen:
                return value
            if len(self.seen) < self.limit:
                self.seen.add(value)
                return value
        return "other"


AGENTS = BoundedLabel()


def route_of(path: str, routes: Iterable[str]) -> str:
    """`path` when it is one of `routes` (a route ending in `/*` matches its prefix), else `other`."""
    for route in routes:
        if path == route or (route.endswith("/*") and path.startswith(route[:-1])):
            return route
    return "other"


def count_tokens(server: str, agent: str, prompt: int, completion: int) -> None:
    """Add one answered turn's token counts."""
    label = AGENTS(agent)
    if prompt:
        TOKENS.labels(server, label, "prompt").inc(prompt)
    if completion:
        TOKENS.labels(server, label, "completion").inc(completion)


def count_gate(record: Mapping[str, Any]) -> None:
    """Count one `gate.jsonl` record (a gate decision or a regression-watch outcome)."""
    agent = AGENTS(str(record.get("agent_id") or "default"))
    decision = str(record.get("decision") or "unknown")
    GATE.labels(agent, decision if decision.replace("_", "").isalpha() else "unknown").inc()
    if decision == "rolled_back":
        ROLLBACKS.labels(agent).inc()


def exposition() -> tuple[bytes, str]:
    """The registry in Prometheus text format, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Counts and times every HTTP request (`metaclaw_requests`, `metaclaw_request_duration_seconds`).

    Args:
        app: the ASGI app measured.
        server: the `server` label (`proxy`, `policy`).
        routes: the server's paths; any other path is counted as `other`.
        agent_of: the agent label of a request from its headers (lower-case names), bounded by the caller; None:
            `all` (the policy server, which labels its tokens by the model name asked for instead).
    """

    def __init__(self, app: ASGIApp, server: str, routes: Iterable[str],
                 agent_of: Callable[[dict[str, str]], str] | None = None) -> None:  # fmt: skip
        self.app, self.server, self.route_paths, self.agent_of = app, server, tuple(routes), agent_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = route_of(scope["path"], self.route_paths)
            agent = "all"
            if self.agent_of is not None:
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
                agent = self.agent_of(headers)
            REQUESTS.labels(self.server, route, agent, str(status[0])).inc()
            LATENCY.labels(self.server, route, agent).observe(time.perf_counter() - t0)


class LoopCollector(Collector):
    """The training loop's state, read at scrape time from the store and the served versions.

    Args:
        store: the run's sample store (counts, drop reasons, pace).
        served: what the policy server serves (`metaclaw.store.ServedVersions`), or None.
        window_s: the window of the pace figures (`SampleStore.rates`).
        agent_of_adapter: the agent label of an adapter name (its profile).
    """

    def __init__(self, store: Any, served: Any = None, window_s: float = 300.0,
                 agent_of_adapter: Callable[[str], str] = str) -> None:  # fmt: skip
        self.store, self.served, self.window_s, self.agent_of_adapter = store, served, window_s, agent_of_adapter

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_status = GaugeMetricFamily("metaclaw_samples", "Samples in the store, by status", labels=["status"])
        for status, n in self.store.counts().items():
            by_status.add_metric([status], n)
        yield by_status
        dropped = GaugeMetricFamily("metaclaw_samples_dropped", "Dropped samples, by reason", labels=["reason"])
        for reason, n in self.store.dropped_reasons().items():
            dropped.add_metric([reason], n)
        yield dropped
        rates = self.store.rates(self.window_s)
        pace = (("metaclaw_replies_per_minute", "replies_per_min", "Main turns captured per minute"),
                ("metaclaw_trained_samples_per_minute", "trained_per_min", "Samples trained per minute"),
                ("metaclaw_sample_age_seconds", "trained_age_s", "Median age (capture to training) of trained samples"),
                ("metaclaw_trainer_lag_versions", "trained_lag",
                 "Median adapter versions from the one that sampled a trained sample to the one served"))  # fmt: skip
        for name, key, doc in pace:
            if rates.get(key) is not None:
                yield GaugeMetricFamily(name, f"{doc}, over the last {self.window_s:g} s", value=rates[key])
        if self.served is not None:
            version = GaugeMetricFamily("metaclaw_served_adapter_version", "Adapter version the policy server serves,"
                                        " by agent (0: the base model)", labels=["agent"])  # fmt: skip
            version.add_metric(["default"], self.served.default)
            for adapter, v in sorted(self.served.by_adapter.items()):
                if adapter != "default":
                    version.add_metric([self.agent_of_adapter(adapter)], v)
            yield version


def watch_loop(collector: LoopCollector) -> Callable[[], None]:
    """Register `collector`; the returned callable unregisters it (one run after another in one process)."""
    REGISTRY.register(collector)
    return lambda: REGISTRY.unregister(collector)
