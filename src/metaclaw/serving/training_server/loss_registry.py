"""`loss_fn` names → policy losses, built by Hydra from `app.losses` (the same classes `train.py` uses)."""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from metaclaw.serving.training_server.errors import bad_request

# Tinker's loss_fn_config gives absolute ratio thresholds; the loss classes take ε (distance from 1).
_THRESHOLDS = {
    "clip_low_threshold": ("clip_low", lambda v: 1.0 - v),
    "clip_high_threshold": ("clip_high", lambda v: v - 1.0),
}


class LossRegistry:
    """Builds the loss a request names, with its `loss_fn_config` overrides.

    Args:
        configs: `app.losses`: name → Hydra config with `_target_` (e.g. `metaclaw.losses.PPOLoss`).
    """

    def __init__(self, configs: DictConfig) -> None:
        self.configs = configs

    @property
    def names(self) -> list[str]:
        return list(self.configs.keys())

    def build(self, name: str, overrides: dict[str, Any] | None = None) -> nn.Module:
        """400 naming `loss_fn` for an unknown name, `loss_fn_config` for a setting the loss refuses."""
        if name not in self.configs:
            raise bad_request(f"unknown loss_fn {name!r}; valid: {', '.join(self.names)}", "loss_fn")
        kwargs = {}
        for key, value in (overrides or {}).items():
            if key in _THRESHOLDS:
                target, convert = _THRESHOLDS[key]
                if not isinstance(value, int | float):
                    raise bad_request(f"loss_fn_config.{key} must be a number, got {value!r}", f"loss_fn_config.{key}")
                kwargs[target] = convert(float(value))
            else:
                kwargs[key] = value
        try:
            return instantiate(self.configs[name], **kwargs)
        except Exception as exc:  # unknown keyword or a value the loss refuses (it raises ValueError naming it)
            cause = exc.__cause__ or exc
            raise bad_request(f"loss_fn_config for {name!r} is invalid: {cause}", "loss_fn_config") from exc
