"""An adapter from elsewhere read as data (`metaclaw import`): its files with size caps and without following links,
its config against the LoRA fields metaclaw supports, its numbers finite and in range.

Only `SUPPORTED` fields are read. `DESCRIPTIVE` fields (what PEFT writes about itself) are checked for type and then
ignored. Any other field must hold its inert value (null, false, empty, or PEFT's own default for it): one that
asks for something (`megatron_config`, `loftq_config`, `init_lora_weights: pissa`, `layer_replication`, DoRA, ...)
is refused by name, since it would reach PEFT code that can import modules or run an initialisation. PEFT itself
is never handed this config: the importer builds a clean `LoraConfig` from the fields it read.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from metaclaw.export.runs import ExportError

MAX_CONFIG_BYTES = 64 * 1024
MAX_ALPHA = 1e4  # |lora_alpha|; real adapters use 1..512
MAX_SCALE = 1e3  # alpha / r (or / sqrt(r) with rsLoRA)
MAX_ABS_WEIGHT = 1e3  # a LoRA factor's entries; trained ones stay below ~10
SUPPORTED = frozenset({"peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "bias",
                       "base_model_name_or_path"})  # fmt: skip
DESCRIPTIVE: dict[str, tuple[type, ...]] = {"task_type": (str, type(None)), "peft_version": (str, type(None)),
                                            "revision": (str, type(None)), "inference_mode": (bool,),
                                            "lora_dropout": (int, float)}  # fmt: skip
PEFT_DEFAULTS: dict[str, Any] = {"megatron_core": "megatron.core", "qalora_group_size": 16, "init_lora_weights": True}


def _refuse_constant(name: str) -> Any:
    raise ExportError(f"adapter_config.json holds {name}: numbers must be finite")


def read_capped(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file (not a link, not a device) of at most `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ExportError(f"{path.name} cannot be opened as a regular file (a link is not followed): {e}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ExportError(f"{path.name} is not a regular file")
        if st.st_size > limit:
            raise ExportError(f"{path.name} is {st.st_size} bytes, over the {limit} a LoRA of this run can need")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ExportError(f"{path.name} is over {limit} bytes")
    return data


def read_config(path: Path) -> dict[str, Any]:
    """`adapter_config.json` as a JSON object (size-capped, no link followed, no NaN/Infinity)."""
    try:
        config = json.loads(read_capped(path, MAX_CONFIG_BYTES), parse_constant=_refuse_constant)
    except ValueError as e:
        raise ExportError(f"{path.name} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise ExportError(f"{path.name} must be a JSON object")
    return config


def _inert(key: str, value: Any) -> bool:
    if key in PEFT_DEFAULTS and value == PEFT_DEFAULTS[key] and type(value) is type(PEFT_DEFAULTS[key]):
        return True
    return value is None or value is False or value in ({}, [], "") or (key == "init_lora_weights" and value is False)


def check_fields(config: dict[str, Any]) -> None:
    """Refuse, by name, every field that is neither read, descriptive, nor at its inert value."""
    for key, types in DESCRIPTIVE.items():
        if key in config and (not isinstance(config[key], types) or isinstance(config[key], bool) != (bool in types)):
            raise ExportError(f"adapter_config.json field {key}={config[key]!r} has the wrong type")
    refused = sorted(k for k, v in config.items() if k not in SUPPORTED and k not in DESCRIPTIVE and not _inert(k, v))
    if refused:
        shown = ", ".join(f"{k}={json.dumps(config[k])[:60]}" for k in refused)
        raise ExportError(f"adapter_config.json fields not supported: {shown} (metaclaw imports plain LoRA and reads "
                          f"only {', '.join(sorted(SUPPORTED))}; these would reach PEFT code)")  # fmt: skip


def check_numbers(r: Any, alpha: Any, rslora: bool) -> float:
    """The adapter's scale (alpha / r, or / sqrt(r) with rsLoRA), once `r` and `alpha` are sane numbers."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ExportError(f"r={r!r} must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha == 0:
        raise ExportError(f"lora_alpha={alpha!r} must be a finite non-zero number")
    if abs(alpha) > MAX_ALPHA:
        raise ExportError(f"lora_alpha={alpha!r} is over {MAX_ALPHA:g} in size: no trained LoRA uses that")
    scale = alpha / r**0.5 if rslora else alpha / r
    if abs(scale) > MAX_SCALE:
        raise ExportError(f"lora_alpha / r = {scale:g} is over {MAX_SCALE:g} in size")
    return float(scale)
