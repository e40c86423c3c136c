"""`UpstreamPools`: the proxy's keep-alive connection pools to the policy server, and what the server lists.

The pools are sharded (`POOL_SHARDS`), so that many agents' requests do not queue on one pool's lock; the first
pool also re-reads `/v1/models` every `refresh_s` (the proxy notices the first adapter, and each model's card:
its modalities and context length).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import httpx

from metaclaw.wire.client import CallError, Endpoint, models

POOL_SHARDS = 16
MAX_UPSTREAM_CONNECTIONS = 512


class UpstreamPools:
    """Connection pools to `url` (with or without `/v1`; bearer `api_key`, `timeout_s` per request);
    `models`/`cards` as last listed."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float, refresh_s: float) -> None:
        self.endpoint = Endpoint(url, api_key)  # with or without /v1: one URL rule
        self.url, self.api_key, self.timeout_s, self.refresh_s = self.endpoint.root, api_key, timeout_s, refresh_s
        self.client: httpx.AsyncClient | None = None  # the first pool: model refreshes
        self._clients: list[httpx.AsyncClient] = []
        self._next: Iterator[httpx.AsyncClient] = iter(())
        self.chat_url = httpx.URL(f"{self.url}/v1/chat/completions")  # absolute: no per-request merge
        self.models: set[str] = set()
        self.cards: dict[str, dict[str, Any]] = {}  # /v1/models entries: modalities, max_model_len
        self._refresher: asyncio.Task | None = None

    async def start(self, refresh: bool) -> None:
        """Open the pools; with `refresh` (and `refresh_s` > 0), read the model list now and every `refresh_s`."""
        headers = self.endpoint.headers()
        per_pool = MAX_UPSTREAM_CONNECTIONS // POOL_SHARDS
        limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
        kw: dict[str, Any] = dict(base_url=self.url, headers=headers, timeout=self.timeout_s, limits=limits)
        self._clients = [httpx.AsyncClient(**kw) for _ in range(POOL_SHARDS)]
        self.client, self._next = self._clients[0], itertools.cycle(self._clients)
        if refresh and self.refresh_s > 0:
            await self.refresh()
            self._refresher = asyncio.create_task(self._refresh_loop())

    async def stop(self) -> None:
        if self._refresher:
            self._refresher.cancel()
        for client in self._clients:
            await client.aclose()
        self._clients, self.client = [], None

    def next(self) -> httpx.AsyncClient:
        """The next pool, round robin."""
        return next(self._next)

    async def refresh(self) -> None:
        """Read `/v1/models` now (the one outbound client's `models`; no pool needed); a failure keeps the last."""
        try:
            data = await asyncio.to_thread(models, self.endpoint, 5.0)
            self.models = {m["id"] for m in data}
            self.cards = {m["id"]: m for m in data}
        except (CallError, ValueError, KeyError, TypeError):
            pass

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
