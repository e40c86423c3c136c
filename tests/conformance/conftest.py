"""The conformance rig: the real policy server (`serve.py model=tiny`, one per session) and the real proxy in
front of it (one per module, its own store), driven by the official `openai` and `anthropic` SDKs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from metaclaw.rollout.fit import ClientFit, ContextPolicy, ImagePolicy
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.store import SampleStore

PROXY_KEY = "conformance-proxy-key"


@dataclass
class Rig:
    url: str  # the proxy
    server_url: str
    server_key: str
    store: SampleStore
    proxy: RolloutProxy
    tokenizer: object

    def last(self):
        return self.store.select()[-1]


@pytest.fixture(scope="module")
def rig(tiny_policy_server, tiny_tokenizer, tmp_path_factory) -> Iterator[Rig]:
    store = SampleStore(tmp_path_factory.mktemp("conformance-store") / "samples.sqlite")
    fit = ClientFit(ImagePolicy(), ContextPolicy(tokenizer=tiny_tokenizer, reserve_tokens=32))
    server = tiny_policy_server
    proxy = RolloutProxy(store, server.url, upstream_api_key=server.key, base_model="tiny", fit=fit)
    with ThreadedServer(create_app(proxy, api_key=PROXY_KEY)) as srv:
        yield Rig(srv.url, server.url, server.key, store, proxy, tiny_tokenizer)
