"""The FastAPI app: seed 000's endpoints, path for path; bearer auth on all but `/v1/health`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI

from metaclaw.training_server.engine import TrainingEngine
from metaclaw.training_server.errors import drop_422, install_error_handlers
from metaclaw.training_server.routers import ROUTERS, Served
from metaclaw.training_server.vllm_sampler import EngineSampler
from metaclaw.training_server.worker import ModelOwner
from metaclaw.wire.security import (
    BearerAuthMiddleware,
    BodySizeLimitMiddleware,
    BrowserGuard,
    BrowserGuardMiddleware,
)

OPEN_PATHS = ("/v1/health", "/health")
log = logging.getLogger(__name__)

try:  # the Tinker-compatible API needs the tinker extra (tinker, zstandard, protobuf)
    from metaclaw.training_server.tinker_api import mount as mount_tinker

    TINKER_MISSING: ModuleNotFoundError | None = None
except ModuleNotFoundError as e:
    if e.name not in ("tinker", "zstandard", "google") and not str(e.name).startswith(("tinker.", "google.")):
        raise
    mount_tinker, TINKER_MISSING = None, e  # type: ignore[assignment]

try:
    VERSION = version("metaclaw")
except PackageNotFoundError:  # running from a source tree without installing
    VERSION = "0.1.0"


def create_app(engine: TrainingEngine, vllm: EngineSampler | None = None) -> FastAPI:
    """Wire the engine into HTTP routes, one router per resource (`routers`); model work runs on one owner
    thread, vLLM work on another."""
    settings = engine.settings
    owner = ModelOwner("metaclaw-model")
    served = Served(engine, owner, ModelOwner("metaclaw-infer") if vllm is not None else owner, vllm, VERSION)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(served.sweep()) if engine.limits.session_idle_s else None
        yield
        if sweeper is not None:
            sweeper.cancel()
        owner.shutdown()
        served.infer.shutdown()

    app = FastAPI(title="MetaClaw training server", version=VERSION, lifespan=lifespan, docs_url=None,
                  redoc_url=None)  # no CDN-scripted pages; /openapi.json stays  # fmt: skip
    install_error_handlers(app)
    drop_422(app)
    tinker_key = f"tml-{settings.api_key}" if settings.api_key and not settings.api_key.startswith("tml-") else ""
    # The last middleware added runs first: the key is checked before a byte of the body is read, so a keyless
    # client cannot make the server buffer up to max_body_bytes (issue 31).
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(BearerAuthMiddleware, api_key=settings.api_key, open_paths=OPEN_PATHS, extra_keys=(tinker_key,))
    # outermost: a web page in the user's browser is refused by Host (DNS rebinding) and Origin before anything else
    app.add_middleware(BrowserGuardMiddleware, guard=BrowserGuard(settings.host), checks="origin")
    for router in ROUTERS:
        app.include_router(router(served))
    if mount_tinker is None:  # the tinker extra; seed 000's API above works without it
        log.warning("The Tinker-compatible API (/api/v1) is off: %s. pip install 'metaclaw[tinker]'", TINKER_MISSING)
        return app
    mount_tinker(app, engine, owner)
    return app
