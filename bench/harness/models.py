"""The model a bench measures: a `conf/model/<name>.yaml` node (the one `train.py model=<name>` uses), in fp32."""

from __future__ import annotations

from typing import Any

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.modules.loading import ModelSpec


def model_names() -> list[str]:
    """Every `conf/model` option (`tiny`, `smollm2_135m`, ...)."""
    return sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))


def model_spec(name: str, **overrides: Any) -> ModelSpec:
    """`conf/model/<name>.yaml` as a `ModelSpec`, float32 (the CPU figures' dtype) unless `overrides` say otherwise.

    Composed as `train.py model=<name>` composes it: a preset extends `conf/model/_spec.yaml` (its defaults list) and
    reads ModelSpec's own defaults (`${metaclaw_default:}`), so the file alone is not the node."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        node = compose("train", overrides=[f"model={name}"]).model
    return instantiate(node, **{"dtype": "float32", **overrides})
