"""Fixtures: a scripted OpenAI-compatible upstream and a rollout proxy in front of it, both on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.store import SampleStore


@dataclass
class ProxyHarness:
    store: SampleStore
    proxy: RolloutProxy
    url: str
    upstream_url: str
    upstream_state: dict[str, Any]


@pytest.fixture
def upstream() -> Iterator[ThreadedServer]:
    with ThreadedServer(scripted_upstream()) as srv:
        yield srv


def make_harness(tmp_path, upstream, **kwargs) -> Iterator[ProxyHarness]:
    store = SampleStore(tmp_path / "samples.sqlite")
    api_key = kwargs.pop("api_key", None)
    max_body = kwargs.pop("max_body_bytes", 1 << 20)
    proxy = RolloutProxy(store, upstream.url, base_model="tiny", **kwargs)
    with ThreadedServer(create_app(proxy, api_key=api_key, max_body_bytes=max_body)) as srv:
        yield ProxyHarness(store, proxy, srv.url, upstream.url, upstream.server.config.app.state.scripted)


@pytest.fixture
def harness(tmp_path, upstream) -> Iterator[ProxyHarness]:
    yield from make_harness(tmp_path, upstream)
