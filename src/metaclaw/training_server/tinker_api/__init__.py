"""A Tinker-compatible API on the training server: the official `tinker` SDK and tinker-cookbook, unmodified.

Mounted under `/api/v1/` on the same FastAPI app as seed 000's routes: same engine, sessions, checkpoint
directory, auth key (sent as `X-API-Key: tml-<key>`) and limits. Needs `pip install 'metaclaw[tinker]'` (the SDK
supplies the wire types); without it, or with `app.tinker.enabled: false`, `/api/v1/*` answers 404 saying so.
See docs/training_server.md, "Tinker compatibility".
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI

from metaclaw.config import LORA_MODULE_GROUPS
from metaclaw.training_server.errors import ApiError

log = logging.getLogger(__name__)

GROUPS = {**LORA_MODULE_GROUPS, "unembed": ("lm_head",)}  # for a config without app.tinker.module_groups


def _unavailable(app: FastAPI, reason: str) -> None:
    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST"], include_in_schema=False)
    async def tinker_unavailable(rest: str) -> None:
        raise ApiError(404, f"the Tinker API is not available on this server: {reason}", "path")


def mount(app: FastAPI, engine: Any, owner: Any) -> None:
    """Add the Tinker routes to `app` (or a 404 explaining why they are missing)."""
    from metaclaw.training_server.tinker_api.registry import TinkerLimits

    cfg = engine.cfg.get("tinker") if hasattr(engine.cfg, "get") else None
    limits = TinkerLimits.from_config({k: v for k, v in dict(cfg or {}).items() if k != "module_groups"})
    if not limits.enabled:
        _unavailable(app, "disabled by app.tinker.enabled")
        return
    try:
        from metaclaw.training_server.tinker_api.routes import install
    except ImportError as exc:
        log.info("Tinker API off: %s (pip install 'metaclaw[tinker]')", exc)
        _unavailable(app, "install it with pip install 'metaclaw[tinker]'")
        return
    groups = {k: list(v) for k, v in dict((cfg or {}).get("module_groups") or GROUPS).items()}
    install(app, engine, owner, limits, groups)
