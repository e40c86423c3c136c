"""The reliability rig: the real tiny policy server (shared per session), the real proxy in front of it, the
real training server in-process (tiny model), and each one's route table from its own app object."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hydra import compose, initialize_config_dir

from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.rollout.fit import ClientFit, ContextPolicy, ImagePolicy
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.store import SampleStore

PROXY_KEY = "reliability-proxy-key"


@dataclass
class Surface:
    """One server as the suite sees it: where it listens, its key, its route table, its open paths."""

    name: str
    url: str
    key: str
    app: Any  # the FastAPI app whose routes are served at `url`
    open_paths: tuple[str, ...]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def alive(self) -> bool:
        health = "/v1/health" if "/v1/health" in self.open_paths else "/health"
        return httpx.get(f"{self.url}{health}", timeout=30).status_code == 200


def fastapi_app(app: Any) -> Any:
    """The FastAPI app inside our ASGI middlewares (each wraps the next as `.app`)."""
    while not hasattr(app, "routes"):
        app = app.app
    return app


def serve_cfg(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="serve", overrides=list(overrides))


@pytest.fixture(scope="session")
def policy_surface(tiny_policy_server, tmp_path_factory) -> Surface:
    """The live policy server, and the route table of the same app built in-process from the same config."""
    from metaclaw.serving.policy_app import build_server

    adapters = tmp_path_factory.mktemp("route-table-adapters")
    server, _ = build_server(serve_cfg("model=tiny", f"serve.adapter_root={adapters}"))
    return Surface("policy", tiny_policy_server.url, tiny_policy_server.key, server.app, ("/health",))


@pytest.fixture(scope="session")
def proxy_surface(tiny_policy_server, tiny_tokenizer, tmp_path_factory) -> Iterator[Surface]:
    store = SampleStore(tmp_path_factory.mktemp("reliability-store") / "samples.sqlite")
    fit = ClientFit(ImagePolicy(), ContextPolicy(tokenizer=tiny_tokenizer, reserve_tokens=32))
    proxy = RolloutProxy(store, tiny_policy_server.url, upstream_api_key=tiny_policy_server.key, base_model="tiny",
                         fit=fit)  # fmt: skip
    app = create_app(proxy, api_key=PROXY_KEY, max_body_bytes=1 << 20)
    with ThreadedServer(app) as srv:
        yield Surface("proxy", srv.url, PROXY_KEY, fastapi_app(app), ("/health",))


@pytest.fixture(scope="session")
def training_surface(tmp_path_factory) -> Iterator[Surface]:
    """The training server (tiny model) built in-process by its own entry point and served by uvicorn."""
    from metaclaw.training_server.main import build

    key = "reliability-training-key"
    ckpt = tmp_path_factory.mktemp("reliability-training")
    app, _ = build(serve_cfg("app=training_server", "model=tiny", "devices=cpu", f"serve.api_key={key}",
                             "app.inference_backend=hf", f"app.checkpoint_dir={ckpt}",
                             f"serve.adapter_root={ckpt}"))  # fmt: skip
    with ThreadedServer(app) as srv:
        yield Surface("training", srv.url, key, fastapi_app(app), ("/v1/health", "/health"))
