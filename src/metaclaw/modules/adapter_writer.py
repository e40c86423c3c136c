"""`AdapterWriter`: writes a run's adapter and checkpoint files where `metaclaw.runfiles.layout` puts them: a
published version (atomic, with its version recorded inside), the served pointer, the checkpoint (written to
`.tmp`, then renamed), pruning, and the leftovers a kill mid-write leaves."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from metaclaw.agents import DEFAULT_ADAPTER
from metaclaw.atomic import write_dir_atomically
from metaclaw.runfiles.layout import AdapterFolder, RunLayout, write_adapter_info
from metaclaw.wire import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def clean_leftovers(run_dir: Path) -> list[Path]:
    """Remove what a kill mid-write leaves in `run_dir` (relative paths of what was removed, sorted).

    `write_dir_atomically` fills `adapters/.step-NNNNNN-xxxx` and parks the replaced copy in
    `adapters/.step-NNNNNN.old`; the checkpoint is written to `checkpoints/last.ckpt.tmp` first.
    """
    removed = []
    for path in RunLayout(run_dir).leftovers():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.relative_to(run_dir))
    return sorted(removed)


def zero_adapter(folder: AdapterFolder) -> Path:
    """Version 0 of `folder` (`step-000000`): the base model as an adapter, every LoRA weight 0, with the config and
    shapes of the newest published version; what a rollback to step 0 serves. Written once, atomically.

    Raises:
        FileNotFoundError: no version was published in `folder` (the base model is served already).
    """
    target = folder.find(0)
    if target is not None:
        return target
    published = [d for v, d in folder.versions() if v > 0]
    if not published:
        raise FileNotFoundError(f"no adapter published in {folder.path}: the base model is what is served")
    source = published[-1]

    def fill(tmp: Path) -> None:
        shutil.copyfile(source / ADAPTER_CONFIG, tmp / ADAPTER_CONFIG)
        weights = load_file(str(source / ADAPTER_WEIGHTS))
        save_file({k: torch.zeros_like(v) for k, v in weights.items()}, str(tmp / ADAPTER_WEIGHTS), {"format": "pt"})
        write_adapter_info(tmp, 0)

    return write_dir_atomically(folder.version_dir(0), fill, replace=False)


class AdapterWriter:
    """Where a run's adapters and its resumable checkpoint live, and how they are written.

    Args:
        run_dir: the run's output directory.
        keep_last: keep only the newest this many published versions (None keeps all).
        adapter: the trainer's adapter whose folder this writes (`default`: `<run_dir>/adapters`; an agent's own
            adapter: `<run_dir>/adapters/agents/<id>`, docs/agents.md).
    """

    def __init__(self, run_dir: str | Path, keep_last: int | None = None, adapter: str = DEFAULT_ADAPTER) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"publish.keep_last must be >= 1 or null, got {keep_last}")
        self.layout = RunLayout(run_dir)
        self.run_dir, self.keep_last = self.layout.run_dir, keep_last
        self.folder: AdapterFolder = self.layout.adapters(adapter)
        self.adapters = self.folder.path

    @property
    def checkpoint_path(self) -> Path:
        return self.layout.checkpoint_path

    @property
    def checkpoint_tmp(self) -> Path:
        """Where the checkpoint is written before `commit_checkpoint` renames it into place."""
        return self.layout.checkpoint_tmp

    def adapter_dir(self, step: int) -> Path:
        return self.folder.version_dir(step)

    def commit_checkpoint(self) -> None:
        os.replace(self.checkpoint_tmp, self.checkpoint_path)

    def write_latest(
        self, step: int, target: Path, lora_name: str, fingerprints: Any, rolled_back: bool = False
    ) -> None:
        """`adapters/latest.json`, the served pointer: what a restarted policy server reloads
        (`loop.live.reload_latest_adapter`) and a restarted run serves. Written atomically (temp file, fsync,
        rename, fsync of the folder). A rollback (`control/plane.py`) writes it too, with `rolled_back: true`,
        so a restart keeps serving the rolled-back adapter until the next publish."""
        extra = {"rolled_back": True} if rolled_back else {}
        self.folder.write_latest(step, target, lora_name, rank_fingerprints=fingerprints, **extra)

    def read_latest(self) -> dict[str, Any] | None:
        """The served pointer (None when there is none or it cannot be read)."""
        return self.folder.read_latest()

    def prune(self, keep: Iterable[Path] = ()) -> None:
        """Remove all but the newest `keep_last` adapter dirs; never the served one (`latest.json`: with the gate
        on it may be older than the newest) nor those in `keep` (candidates the gate has not measured yet)."""
        if self.keep_last is None:
            return
        served = (self.read_latest() or {}).get("path")
        kept = {Path(p).resolve() for p in keep} | ({Path(served).resolve()} if served else set())
        for _, old in self.folder.versions()[: -self.keep_last]:
            if old.resolve() not in kept:
                shutil.rmtree(old, ignore_errors=True)
