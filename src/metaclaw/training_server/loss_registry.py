"""`loss_fn` names → policy losses; `loss_fn_config` is validated against each loss's typed schema.

The losses themselves come from the server's own config (`app.losses`, Hydra `_target_` nodes resolved once at
start-up). Request data never reaches Hydra or OmegaConf: `loss_fn_config` is checked by a pydantic model per
loss class (declared fields only, plain numbers and enums, ranges checked) and the validated values are passed
to the loss class as ordinary Python keyword arguments on top of the trusted defaults.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from metaclaw.training_server.errors import bad_request

Aggregation = Literal["token-mean", "seq-mean", "sum"]
Epsilon = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
EpsilonHigh = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]


class _Strict(BaseModel):
    """Declared fields only (anything else is refused); strict types: no strings for numbers."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def kwargs(self) -> dict[str, Any]:
        """The loss constructor's keyword arguments the request set."""
        return self.model_dump(exclude_none=True)


class _NoConfig(_Strict):
    """A configured loss without a declared schema: `loss_fn_config` must be empty."""


class LossConfig(_Strict):
    """Fields every known loss accepts."""

    aggregation: Aggregation | None = None


class ImportanceSamplingConfig(LossConfig):
    """`importance_sampling`: only the aggregation may be changed."""


class ClippedLossConfig(LossConfig):
    """`ppo` and `cispo`: ε form (`clip_low`, `clip_high`) or Tinker's absolute ratio thresholds.

    `clip_low_threshold` t maps to `clip_low = 1 - t` (t in [0, 1]); `clip_high_threshold` t maps to
    `clip_high = t - 1` (t in [1, 101]). Giving both forms of one bound is refused.
    """

    clip_low: Epsilon | None = None
    clip_high: EpsilonHigh | None = None
    clip_low_threshold: Epsilon | None = None
    clip_high_threshold: Annotated[float, Field(ge=1.0, le=101.0, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _one_form_per_bound(self) -> ClippedLossConfig:
        if self.clip_low is not None and self.clip_low_threshold is not None:
            raise ValueError("give clip_low or clip_low_threshold, not both")
        if self.clip_high is not None and self.clip_high_threshold is not None:
            raise ValueError("give clip_high or clip_high_threshold, not both")
        return self

    def kwargs(self) -> dict[str, Any]:
        out = {"aggregation": self.aggregation, "clip_low": self.clip_low, "clip_high": self.clip_high}
        if self.clip_low_threshold is not None:
            out["clip_low"] = 1.0 - self.clip_low_threshold
        if self.clip_high_threshold is not None:
            out["clip_high"] = self.clip_high_threshold - 1.0
        return {k: v for k, v in out.items() if v is not None}


# The schema of each loss class the server knows; a configured loss not listed here takes no loss_fn_config.
SCHEMAS: dict[str, type[_Strict]] = {
    "metaclaw.losses.importance_sampling.ImportanceSamplingLoss": ImportanceSamplingConfig,
    "metaclaw.losses.ppo.PPOLoss": ClippedLossConfig,
    "metaclaw.losses.cispo.CISPOLoss": ClippedLossConfig,
    "metaclaw.losses.cross_entropy.CrossEntropyLoss": LossConfig,
}


def _field_path(loc: tuple) -> str:
    return ".".join(["loss_fn_config", *(str(part) for part in loc)])


class LossRegistry:
    """Builds the loss a request names, with its validated `loss_fn_config`.

    Args:
        configs: `app.losses` (trusted server config): name → Hydra node with `_target_` and defaults.
    """

    def __init__(self, configs: DictConfig | dict[str, Any]) -> None:
        resolved = OmegaConf.to_container(configs, resolve=True) if isinstance(configs, DictConfig) else configs
        self._entries: dict[str, tuple[type[nn.Module], dict[str, Any], type[_Strict]]] = {}
        for name, node in dict(resolved).items():
            node = dict(node)
            target = str(node.pop("_target_"))
            self._entries[str(name)] = (get_class(target), node, SCHEMAS.get(target, _NoConfig))

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def schema(self, name: str) -> type[_Strict]:
        return self._entries[name][2]

    def validate(self, name: str, config: Any) -> dict[str, Any]:
        """Request `loss_fn_config` → constructor kwargs; 400 naming the offending field."""
        if name not in self._entries:
            raise bad_request(f"unknown loss_fn {name!r}; valid: {', '.join(self.names)}", "loss_fn")
        if config is None:
            return {}
        if not isinstance(config, dict):
            raise bad_request("loss_fn_config must be an object", "loss_fn_config")
        schema = self.schema(name)
        try:
            return schema.model_validate(config).kwargs()
        except ValidationError as exc:
            err = exc.errors()[0]
            where = _field_path(tuple(err.get("loc", ())))
            if err.get("type") == "extra_forbidden":
                allowed = ", ".join(schema.model_fields) or "none"
                message = f"{where} is not a setting of loss_fn {name!r} (allowed: {allowed})"
            else:
                message = f"{where}: {str(err.get('msg', 'invalid value')).removeprefix('Value error, ')}"
            raise bad_request(message, where) from None

    def build(self, name: str, config: Any = None) -> nn.Module:
        """The loss module: trusted defaults from the config, overridden by the validated request settings."""
        kwargs = self.validate(name, config)
        cls, defaults, _ = self._entries[name]
        try:
            return cls(**{**defaults, **kwargs})
        except ValueError as exc:  # a combination the loss refuses (it names the values)
            raise bad_request(f"loss_fn_config for {name!r} is invalid: {exc}", "loss_fn_config") from None
