"""Issue 43 (finding 8): the keyless proxy served FastAPI's `/docs` and `/redoc`, pages that load scripts from a
CDN, on the origin the dashboard shares. They are off unless `rollout.proxy.api_docs` asks for them."""

from __future__ import annotations

import httpx
from hydra import compose, initialize_config_module

from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.store import SampleStore


def test_docs_pages_are_off_unless_asked_for(tmp_path):
    store = SampleStore(tmp_path / "samples.sqlite")
    for api_docs, status in ((False, 404), (True, 200)):
        app = create_app(RolloutProxy(store, "http://127.0.0.1:9", base_model="tiny", model_refresh_s=0),
                         api_docs=api_docs)  # fmt: skip
        with ThreadedServer(app) as srv:
            for path in ("/docs", "/redoc"):
                r = httpx.get(f"{srv.url}{path}", timeout=10)
                assert r.status_code == status and ("cdn" in r.text.lower()) == api_docs, path
            assert httpx.get(f"{srv.url}/openapi.json", timeout=10).status_code == 200
    store.close()
    with initialize_config_module("metaclaw.conf", version_base="1.3"):
        cfg = compose("train", overrides=["rollout=proxy"])
    assert cfg.rollout.proxy.api_docs is False  # the default the live service takes
