"""The training server's settings, read once from the composed Hydra config (`conf/app/training_server.yaml`).

The seed's environment variables are resolved by the YAML (`${oc.env:...}`); this module only parses their
string forms (`"0,1"` device lists, ports) and checks the fields that tie together, naming them on error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from metaclaw.config import ConfigError
from metaclaw.modules.loading import ModelSpec
from metaclaw.wire.security import resolve_api_key

INFERENCE_BACKENDS = ("hf", "vllm")


def _precision(value: str, training_devices: list[int]) -> str:
    """`devices.precision`; `auto` (`metaclaw serve`'s default) is bf16-mixed on GPUs, 32-true on the CPU."""
    if value.strip().lower() == "auto":
        return "bf16-mixed" if training_devices else "32-true"
    return value


def parse_devices(value: Any, fallback: Any, name: str) -> list[int]:
    """`"0,1"` / `[0, 1]` / `null` (→ `fallback`) → `[0, 1]`; `""` or `"cpu"` → `[]` (CPU); `"auto"` → `[0]` on a
    GPU host, else `[]`."""
    if value is None:
        value = fallback
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "cpu", "none", "[]"):
            return []
        if text.lower() == "auto":  # `metaclaw serve`'s default devices: GPU 0 when there is one, else the CPU
            import torch

            return [0] if torch.cuda.is_available() else []
        value = [part for part in text.strip("[]").split(",") if part.strip()]
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} must be comma-separated GPU ids (e.g. 0,1), got {value!r}") from exc


@dataclass(frozen=True)
class Limits:
    """Bounds on what clients can make the server hold (`app.limits`); see docs/training_server.md.

    Attributes:
        max_sessions: live sessions at most; `/v1/lora/create` beyond it is a 429.
        session_idle_s: a session untouched this long is deleted (adapter, gradients, AdamW state); 0: never.
        sweep_interval_s: how often idle sessions are looked for.
        adapter_quota_bytes: total size of `adapters/`; a save that would exceed it is a 507.
        checkpoint_quota_bytes: the same for `checkpoints/`.
        sample_memory: sampled sequences remembered per session for the distribution rule.
    """

    max_sessions: int = 8
    session_idle_s: float = 3600.0
    sweep_interval_s: float = 60.0
    adapter_quota_bytes: int = 10 * 2**30
    checkpoint_quota_bytes: int = 20 * 2**30
    sample_memory: int = 4096

    @classmethod
    def from_config(cls, cfg: Any) -> Limits:
        if cfg is None:
            return cls()
        try:
            limits = cls(
                max_sessions=int(cfg.max_sessions),
                session_idle_s=float(cfg.session_idle_s),
                sweep_interval_s=float(cfg.sweep_interval_s),
                adapter_quota_bytes=int(float(cfg.adapter_quota_mb) * 2**20),
                checkpoint_quota_bytes=int(float(cfg.checkpoint_quota_mb) * 2**20),
                sample_memory=int(cfg.sample_memory),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"app.limits: every limit must be a number ({exc})") from exc
        if limits.max_sessions < 1 or limits.session_idle_s < 0 or limits.sweep_interval_s <= 0:
            raise ConfigError("app.limits: need max_sessions >= 1, session_idle_s >= 0, sweep_interval_s > 0")
        if limits.adapter_quota_bytes <= 0 or limits.checkpoint_quota_bytes <= 0 or limits.sample_memory < 0:
            raise ConfigError("app.limits: quotas must be positive and sample_memory >= 0")
        return limits


def _allowed_base_models(app: Any) -> tuple[str, ...]:
    """The switch targets: none unless `app.allow_base_model_switch`, then exactly `app.allowed_base_models`.

    A key holder must not be able to load any local directory or hub id (nor probe paths through the errors), so
    switching names its targets in the config; switching on with an empty list is a config error.
    """
    allowed = tuple(str(m).strip().rstrip("/") for m in (app.get("allowed_base_models") or []) if str(m).strip())
    if not bool(app.get("allow_base_model_switch", False)):
        return ()
    if not allowed:
        raise ConfigError(
            "app.allow_base_model_switch: true needs app.allowed_base_models (the hub ids or paths it may load)"
        )
    return allowed


@dataclass
class ServerSettings:
    """Everything `run()` and the engine need, already parsed.

    Attributes:
        model: the base model served and trained (one in memory).
        host: interface to bind (127.0.0.1 by default).
        port: TCP port.
        api_key: bearer key; None disables auth (health stays open either way).
        checkpoint_dir: root of `adapters/` and `checkpoints/`; request paths are confined to it.
        training_devices: GPU ids for training (the first one is used); empty: CPU.
        inference_devices: GPU ids for the vLLM engine.
        inference_backend: `hf` (sample from the training model) or `vllm` (hot-swapped adapters).
        precision: Lightning Fabric precision for training (`32-true`, `bf16-mixed`, ...).
        app: the raw `app` config (losses, optimizer, lora, sampling) for Hydra instantiation.
        backend: the raw `backend` config (vLLM engine options).
        limits: session cap, idle expiry, disk quotas.
        allowed_base_models: the model ids `/v1/lora/create` may switch to (while no session is live); empty:
            the served model only (`app.allow_base_model_switch: false`).
    """

    model: ModelSpec
    host: str
    port: int
    api_key: str | None
    checkpoint_dir: Path
    training_devices: list[int]
    inference_devices: list[int]
    inference_backend: str
    precision: str
    log_level: str = "INFO"
    max_body_bytes: int = 64 * 1024 * 1024
    limits: Limits = field(default_factory=Limits)
    allowed_base_models: tuple[str, ...] = ()
    app: DictConfig = field(default_factory=lambda: OmegaConf.create({}))
    backend: DictConfig = field(default_factory=lambda: OmegaConf.create({}))

    @classmethod
    def from_config(cls, cfg: DictConfig) -> ServerSettings:
        """Build from the composed `serve.yaml` + `app=training_server` config."""
        from hydra.utils import instantiate

        app = cfg.app
        backend = str(app.inference_backend).strip().lower()
        if backend == "auto":  # `metaclaw serve`'s default backend: vLLM on a GPU host that has it, else HF
            import importlib.util

            import torch

            gpu_vllm = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None
            backend = "vllm" if gpu_vllm else "hf"
        if backend not in INFERENCE_BACKENDS:
            raise ConfigError(
                f"app.inference_backend / METACLAW_INFERENCE_BACKEND must be one of {INFERENCE_BACKENDS}, "
                f"got {backend!r}"
            )
        try:
            port = int(app.port)
        except ValueError as exc:
            raise ConfigError(f"app.port / METACLAW_PORT must be an integer, got {app.port!r}") from exc
        model = instantiate(cfg.model)
        training_devices = parse_devices(
            app.training_devices, cfg.devices.train, "app.training_devices / METACLAW_TRAINING_DEVICES"
        )
        return cls(
            allowed_base_models=_allowed_base_models(app),
            model=model,
            host=str(app.host),
            port=port,
            api_key=resolve_api_key(app.api_key),
            checkpoint_dir=Path(str(app.checkpoint_dir)).expanduser(),
            training_devices=training_devices,
            inference_devices=parse_devices(
                app.inference_devices, cfg.devices.infer, "app.inference_devices / METACLAW_INFERENCE_DEVICES"
            ),
            inference_backend=backend,
            precision=_precision(str(cfg.devices.precision), training_devices),
            log_level=str(app.log_level).upper(),
            max_body_bytes=int(app.max_body_bytes),
            limits=Limits.from_config(app.get("limits")),
            app=app,
            backend=cfg.backend,
        )
