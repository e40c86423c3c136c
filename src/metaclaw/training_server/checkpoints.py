"""Full training state on disk without pickle: adapter (safetensors), optimizer tensors (safetensors), scalars (JSON).

Layout of `<checkpoint_dir>/checkpoints/<name>/`::

    adapter/                  LoraPolicy.save_adapter (adapter_config.json + adapter_model.safetensors)
    optimizer.safetensors     every tensor of optimizer.state_dict()["state"], keyed "<param index>.<key>"
    state.json                step, rank, parameter names, param_groups, non-tensor optimizer state

The directory is written beside its target and renamed into place, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from safetensors.torch import load_file, save_file

from metaclaw.atomic import write_dir_atomically

FORMAT_VERSION = 1
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
ADAPTER_DIR = "adapter"


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split `optimizer.state_dict()` into tensors (for safetensors) and JSON-able scalars."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Rebuild an `optimizer.state_dict()` from `optimizer_to_flat`'s output."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    for index, entry in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(entry)
    return {"state": state, "param_groups": meta["param_groups"]}


def save_training_state(
    target: Path,
    save_adapter: Callable[[Path], Any],
    optimizer: torch.optim.Optimizer,
    info: dict[str, Any],
) -> Path:
    """Write adapter + optimizer + `info` (step, rank, parameter names, ...) as one checkpoint directory."""

    def fill(tmp: Path) -> None:
        save_adapter(tmp / ADAPTER_DIR)
        tensors, meta = optimizer_to_flat(optimizer)
        save_file(tensors, str(tmp / OPTIMIZER_FILE))
        payload = {"format_version": FORMAT_VERSION, **info, "optimizer": meta}
        (tmp / STATE_FILE).write_text(json.dumps(payload, indent=2))

    return write_dir_atomically(target, fill)


Scalar = bool | int | float | None


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """Only plain JSON scalars under ordinary keys: a file's `_target_` or `${...}` string is refused, never run."""
    for key, value in values.items():
        if key.startswith("_") or not (value is None or isinstance(value, bool | int | float)):
            raise ValueError(f"unexpected entry {key[:40]!r} (only numbers and booleans belong here)")
    return values


class _ParamGroup(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    params: list[Annotated[int, Field(ge=0)]]
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    @model_validator(mode="after")
    def _plain_extras(self) -> _ParamGroup:
        _plain(dict(self.model_extra or {}))
        return self


class _OptimizerMeta(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    param_groups: list[_ParamGroup]
    scalars: dict[str, dict[str, Scalar]] = {}

    @field_validator("scalars")
    @classmethod
    def _plain_scalars(cls, value: dict[str, dict[str, Scalar]]) -> dict[str, dict[str, Scalar]]:
        for entry in value.values():
            _plain(entry)
        return value


class StateFile(BaseModel):
    """`state.json`, validated: a checkpoint directory is data, whoever wrote it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format_version: Literal[1]
    step: Annotated[int, Field(ge=0)]
    rank: Annotated[int, Field(ge=1)]
    base_model: str
    param_names: list[str]
    optimizer: _OptimizerMeta


def read_training_state(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(`state.json` contents, optimizer tensors) of a checkpoint; raises FileNotFoundError/ValueError."""
    state_file = directory / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"not a checkpoint (no {STATE_FILE})")
    try:
        state = StateFile.model_validate_json(state_file.read_bytes())
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise ValueError(f"{STATE_FILE} is invalid at {where or 'top level'}: {err.get('msg')}") from None
    info = state.model_dump()
    info["optimizer"]["param_groups"] = [
        {**g.model_dump(), "betas": tuple(g.betas)} for g in state.optimizer.param_groups
    ]
    return info, load_file(str(directory / OPTIMIZER_FILE))
