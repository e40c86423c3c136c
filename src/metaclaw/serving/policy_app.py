"""`python serve.py` (app=policy_server): the LitServe policy server.

Builds `PolicyAPI` (engine in LitServe's inference worker) behind our middlewares (bearer key on every route but
`/health` and, with `serve.metrics_open`, `/metrics`; a body-size limit; the request counters), logs what it loads
and where it listens, and serves until interrupted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import litserve as ls
from fastapi import Response
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from metaclaw.ops import metrics
from metaclaw.ops.metrics import MetricsMiddleware
from metaclaw.serving.engines import EngineFactory
from metaclaw.serving.litapi import PolicyAPI, PolicySpec
from metaclaw.serving.litserve_compat import disable_broken_mcp
from metaclaw.wire.openapi import POLICY_SERVER_BODIES, publish_request_bodies
from metaclaw.wire.security import (
    BearerAuthMiddleware,
    BodySizeLimitMiddleware,
    BrowserGuardMiddleware,
    open_server_warning,
    resolve_api_key,
)

log = logging.getLogger(__name__)
ROUTES = ("/health", "/metrics", *(path for path, _, _ in PolicySpec.ROUTES))


async def prometheus() -> Response:
    """`GET /metrics`: Prometheus text format (`metaclaw.ops.metrics`)."""
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)


def effective_config(cfg: DictConfig, spec: Any, factory: EngineFactory, api_key: str | None) -> dict[str, Any]:
    """What this server runs with (reported in `/v1/models` as `metaclaw`): its resolved `model`, `backend`,
    `devices` and `serve` settings (no key) and what they resolve to (device, dtype, context)."""
    nodes = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "backend", "devices", "serve")}
    nodes["serve"].pop("api_key", None)
    nodes["serve"]["auth"] = "bearer key" if api_key else "none"
    device = factory.device()
    nodes["effective"] = {"model_path": str(spec.path), "max_seq_len": int(spec.max_seq_len),
                          "backend": factory.backend["name"], "device": device,
                          "dtype": str(spec.torch_dtype(device)).removeprefix("torch.")}  # fmt: skip
    return nodes


def build_server(cfg: DictConfig) -> tuple[ls.LitServer, dict]:
    """The configured `LitServer` (not started) and a summary of what it serves."""
    spec = instantiate(cfg.model)
    backend = OmegaConf.to_container(cfg.backend, resolve=True)
    threads = (cfg.devices.get("cpu_threads") or {}).get("serve")  # the device plan's share of the CPU
    factory = EngineFactory(model=spec, backend=backend, infer_devices=list(cfg.devices.infer),
                            cpu_threads=threads if isinstance(threads, int) else None)  # fmt: skip
    serve = cfg.serve
    adapter_root = Path(serve.adapter_root).expanduser().resolve()
    adapter_root.mkdir(parents=True, exist_ok=True)
    api_key = resolve_api_key(serve.api_key)
    api = PolicyAPI(
        info=effective_config(cfg, spec, factory, api_key),
        engine_factory=factory,
        adapter_root=str(adapter_root),
        default_max_tokens=serve.default_max_tokens,
        model_root=spec.name,
        request_timeout_s=serve.request_timeout_s,
        max_concurrency=serve.max_concurrency,
        tool_call_format=serve.get("tool_call_format") or "auto",
    )
    # Host / Origin / JSON content type: no web page drives the server (docs/security.md)
    open_paths = ("/health", "/metrics") if serve.get("metrics_open") else ("/health",)  # docs/operate.md
    guard = {"bind_host": serve.host, "allowed_hosts": serve.get("allowed_hosts") or ()}
    server = ls.LitServer(
        api,
        accelerator="cpu",  # the engine places the model itself (devices.infer)
        timeout=serve.request_timeout_s,
        middlewares=[
            (BodySizeLimitMiddleware, {"max_bytes": serve.max_body_bytes}),
            (BrowserGuardMiddleware, {**guard, "checks": "content_type"}),
            (BearerAuthMiddleware, {"api_key": api_key, "open_paths": open_paths}),
            (MetricsMiddleware, {"server": "policy", "routes": ROUTES}),  # counts refused keys (401) too
            (BrowserGuardMiddleware, {**guard, "checks": "origin"}),  # the last one added is the outermost
        ],
    )
    server.app.add_api_route("/metrics", prometheus, methods=["GET"])  # this API server's requests and tokens
    publish_request_bodies(server.app, POLICY_SERVER_BODIES)  # /openapi.json (behind the key like every route)
    summary = {
        "model": spec.name,
        "backend": backend["name"],
        "device": factory.device(),
        "adapter_root": str(adapter_root),
        "auth": "bearer key" if api_key else "none (set METACLAW_API_KEY)",
    }
    return server, summary


def run(cfg: DictConfig) -> None:
    """Serve until interrupted."""
    server, summary = build_server(cfg)
    disable_broken_mcp()  # LitServe's MCP bridge breaks with `mcp` but no `fastmcp` (litserve_compat)
    host, port = cfg.serve.host, int(cfg.serve.port)
    log.info(
        "Policy server: model %s (backend %s, %s), adapters under %s, auth: %s",
        summary["model"], summary["backend"], summary["device"], summary["adapter_root"], summary["auth"],
    )  # fmt: skip
    if summary["auth"].startswith("none"):
        log.warning(open_server_warning("The policy server", host, port, "METACLAW_API_KEY or serve.api_key"))
    log.info("Listening on http://%s:%d (OpenAI API at /v1, health at /health, metrics at /metrics)", host, port)
    server.run(host=host, port=port, generate_client_file=False, num_api_servers=1, log_level="warning")
