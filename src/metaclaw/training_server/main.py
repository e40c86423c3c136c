"""Entry point `run(cfg)` for `serve.py app=training_server`: settings → engine (loads the model) → uvicorn."""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

from metaclaw.training_server.settings import ServerSettings
from metaclaw.wire.security import open_server_warning

log = logging.getLogger(__name__)


def build(cfg: DictConfig):
    """The FastAPI app with its engine, model loaded (tests and benches call this in-process)."""
    from metaclaw.training_server.app import create_app
    from metaclaw.training_server.engine import TrainingEngine
    from metaclaw.training_server.vllm_sampler import make_vllm_sampler

    settings = ServerSettings.from_config(cfg)
    try:
        settings.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(
            f"cannot create checkpoint directory {settings.checkpoint_dir} ({exc}); "
            "set METACLAW_CHECKPOINT_DIR or app.checkpoint_dir"
        ) from exc
    engine = TrainingEngine(settings)
    engine.load_base()
    vllm = None
    if settings.inference_backend == "vllm":
        backend = OmegaConf.to_container(settings.backend, resolve=True)
        vllm = make_vllm_sampler(settings.model, settings.inference_devices, backend)
    log.info(
        "Training server: model %s, backend %s, training on %s, checkpoints in %s, auth %s",
        settings.model.name,
        settings.inference_backend,
        engine.fabric.device,
        settings.checkpoint_dir,
        "on" if settings.api_key else "OFF (set METACLAW_API_KEY)",
    )
    return create_app(engine, vllm), settings


def run(cfg: DictConfig) -> None:
    """Serve until interrupted."""
    import uvicorn

    logging.getLogger("metaclaw").setLevel(str(cfg.app.log_level).upper())
    app, settings = build(cfg)
    if not settings.api_key:
        log.warning(open_server_warning("The training server", settings.host, settings.port))
    log.info("Listening on http://%s:%d (health: /v1/health)", settings.host, settings.port)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())
