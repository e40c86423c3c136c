"""The model a bench measures: a `conf/model/<name>.yaml` node (the one `train.py model=<name>` uses), in fp32."""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import OmegaConf

from metaclaw.config import CONFIG_DIR
from metaclaw.modules.loading import ModelSpec


def model_names() -> list[str]:
    """Every `conf/model` option (`tiny`, `smollm2_135m`, ...)."""
    return sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))


def model_spec(name: str, **overrides: Any) -> ModelSpec:
    """`conf/model/<name>.yaml` as a `ModelSpec`, float32 (the CPU figures' dtype) unless `overrides` say otherwise."""
    return instantiate(OmegaConf.load(CONFIG_DIR / "model" / f"{name}.yaml"), **{"dtype": "float32", **overrides})
