"""A rollout proxy in front of a scripted upstream whose replies are numbered (two conversations that open alike
get different replies, as with a sampling model), on free 127.0.0.1 ports: the rig of the trust tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.store import SampleStore


@dataclass
class Rig:
    url: str
    store: SampleStore
    proxy: RolloutProxy
    app: Any  # what the server serves (the proxy's guarded app, or it with /control/* mounted)


@contextmanager
def proxy_rig(tmp_path: Path, api_key: str | None = None, wrap: Any = None) -> Iterator[Rig]:
    """The proxy (key `api_key`, none by default, as the live default) and its numbered upstream; `wrap(app)`
    wraps the proxy's app (e.g. a control plane's `mount`)."""
    counter = itertools.count(1)
    with ThreadedServer(scripted_upstream(reply=lambda body: f"Reply number {next(counter)}.")) as upstream:
        store = SampleStore(tmp_path / "samples.sqlite")
        proxy = RolloutProxy(store, upstream.url, base_model="tiny")
        app = create_app(proxy, api_key=api_key, max_body_bytes=1 << 20)
        app = wrap(app) if wrap else app
        with ThreadedServer(app) as srv:
            yield Rig(srv.url, store, proxy, app)
        store.close()


def sessions(store: SampleStore) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in store.select():
        out.setdefault(s.session_id, []).append(s)
    return out
