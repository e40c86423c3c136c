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
from typing import Any

import torch
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


def read_training_state(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(`state.json` contents, optimizer tensors) of a checkpoint; raises FileNotFoundError/ValueError."""
    state_file = directory / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint (no {STATE_FILE})")
    info = json.loads(state_file.read_text())
    if info.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint format {info.get('format_version')!r} is not {FORMAT_VERSION}")
    return info, load_file(str(directory / OPTIMIZER_FILE))
