"""Experiment tracking: the run's loggers, its hyperparameters and (W&B) its adapters as versioned artifacts.

- `logger` is one logger node (`logger=csv|wandb|none`) or several, named (`logger=csv_wandb`, or any
  `{name: {_target_: ...}}` node): each is instantiated; Lightning logs every metric to all of them.
- `log_hyperparams`: the resolved config goes to every logger, keys left out (any field whose name says it holds a
  credential, as `metaclaw.runfiles` defines it: `api_key`, `*_key`, `token`, `secret`, `password`).
- `AdapterArtifacts` (only with a W&B logger): each adapter the policy server serves (the gate let it through)
  becomes a version of the `adapter` artifact (aliases `step-N`, `latest`, `served`; W&B moves `served` to the
  newest version logged with it); `artifacts.every_n_steps=N` also logs every N-th step's. Not every step: a
  Qwen3-8B rank-16 adapter is ~175 MB. Works offline: `wandb sync` uploads them later.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

WANDB_TARGET = "lightning.pytorch.loggers.WandbLogger"
REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"(?:^|_)(?:api_key|key|token|secret|password)$", re.I)


class MissingExtra(RuntimeError):
    """A configured feature needs an optional dependency that is not installed; the message says which."""


def logger_nodes(cfg: DictConfig) -> dict[str, DictConfig]:
    """`{name: node}` of the configured loggers: `logger` itself when it has a `_target_`, else its named nodes."""
    node = cfg.get("logger")
    if not node:
        return {}
    if "_target_" in node:
        return {"logger": node} if node.get("_target_") else {}
    return {name: sub for name, sub in node.items() if isinstance(sub, DictConfig) and sub.get("_target_")}


def check_loggers(cfg: DictConfig) -> None:
    """Refuse, before anything loads, a W&B logger without wandb installed (the `wandb` extra)."""
    for name, node in logger_nodes(cfg).items():
        if node.get("_target_") == WANDB_TARGET and importlib.util.find_spec("wandb") is None:
            raise MissingExtra(f"logger {name!r} is W&B ({WANDB_TARGET}), but wandb is not installed: "
                               "pip install 'metaclaw[wandb]' (or choose logger=csv)")  # fmt: skip


def build_loggers(cfg: DictConfig) -> list:
    """Every configured logger, instantiated (none: `logger=none`)."""
    check_loggers(cfg)
    return [instantiate(node) for node in logger_nodes(cfg).values()]


def public_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain data with every credential field's value replaced by `<redacted>`."""
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)

    def scrub(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: (REDACTED if _SECRET_NAME.search(str(k)) and v not in (None, "") else scrub(v))
                    for k, v in value.items()}  # fmt: skip
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    return scrub(data)


def log_hyperparams(loggers: list, cfg: DictConfig) -> None:
    """Give every logger the run's resolved config (keys redacted), once, before training."""
    params = public_config(cfg)
    for lg in loggers:
        lg.log_hyperparams(params)


def is_wandb(lg: Any) -> bool:
    return type(lg).__name__ == "WandbLogger"


class AdapterArtifacts(L.Callback):
    """Log each served adapter (`<adapters>/step-N`) as a version of the W&B artifact `artifact_name`.

    Args:
        adapters: the run's adapter directory (`publish.root`).
        artifact_name: the artifact's name in the W&B project.
        every_n_steps: also log the adapter of every N-th step, served or not (None: only the served ones).
    """

    def __init__(self, adapters: str | Path, artifact_name: str = "adapter", every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"artifacts.every_n_steps must be >= 1 or null, got {every_n_steps}")
        self.adapters, self.artifact_name, self.every_n_steps = Path(adapters), artifact_name, every_n_steps
        self.logged: set[str] = set()
        self.served: str | None = None

    def _served_path(self) -> str | None:
        try:
            info = json.loads((self.adapters / "latest.json").read_text())
        except (OSError, ValueError):
            return None
        path = info.get("path") if isinstance(info, dict) else None
        return str(Path(path).resolve()) if path else None

    def sync(self, trainer: L.Trainer) -> None:
        """Log the adapters published since the last call; move `served` to what the server serves now."""
        runs: list[Any] = [lg for lg in trainer.loggers if is_wandb(lg)]
        if not runs or not trainer.is_global_zero:
            return
        import wandb

        served = self._served_path()
        steps = sorted(p for p in self.adapters.glob("step-*") if (p / "adapter_model.safetensors").exists())
        for path in steps:
            key, step = str(path.resolve()), int(path.name.split("-")[-1])
            if key != served and not (self.every_n_steps and step % self.every_n_steps == 0):
                continue
            aliases = [path.name]
            if key in self.logged and not (key == served and served != self.served):
                continue
            if key == steps[-1].resolve().as_posix():
                aliases.append("latest")
            if key == served:
                aliases.append("served")
            artifact = wandb.Artifact(self.artifact_name, type="lora-adapter",
                                      metadata={"step": step, "path": key, "served": key == served})  # fmt: skip
            artifact.add_dir(str(path))
            for lg in runs:
                lg.experiment.log_artifact(artifact, aliases=aliases)
            self.logged.add(key)
        self.served = served

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.sync(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sync(trainer)
