"""`Rewind`: the trainer goes back to a clean state, and stays there (`forget --rollback`, issue 43).

A rollback asked with `reset_trainer` (what `python -m metaclaw forget --rollback` sends) serves the clean adapter
at once (the control plane, under `Rewind.lock`) and asks the trainer to go back to it. `RewindCallback` does so
before the next optimizer step and before the step in progress is published: it loads the clean adapter's weights
(the base model's clean state: fresh LoRA weights, B = 0, the base model's outputs) and drops AdamW's moments for
them (the moments of the clean step are not kept; fresh ones hold nothing of the forgotten turns), so the next step
trains from the clean state. Every publish carries the generation of the weights it wrote: one written before a
rewind is never served, and its folder is removed (`AdapterPublisher`). A claimed batch that holds a sample no
longer in the store (forgotten after the claim) takes no optimizer step (`train/skipped_forgotten`).

A restart keeps it: each request is also written to the adapter folder's `rewind.json` (`{"path", "done"}`); the
next publish writes the checkpoint and marks the record done (`settle`). A run that starts with a record not done
(the checkpoint it resumes from predates the rewind) applies it again before its first step.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L

from metaclaw.atomic import write_file_atomically
from metaclaw.modules.agent_state import drop_moments
from metaclaw.runfiles.layout import RunLayout
from metaclaw.store import open_store

log = logging.getLogger(__name__)


class Rewind:
    """What the control plane and the trainer share about rewinds: the lock, the generation, the pending requests.

    `generation` counts rewinds; `weights_generation` is the generation the trainer's weights belong to (set when
    the trainer takes the pending requests). `quiesce` holds what waits for hot-loads in flight (the publisher's
    loaders), so that the clean adapter is loaded after them, never before.
    """

    def __init__(self, run_dir: str | Path | None = None) -> None:
        self.layout = RunLayout(run_dir) if run_dir is not None else None  # where the records are kept
        self.applied: set[str] = set()  # adapters rewound since the last checkpoint (`settle` marks them done)
        self.lock = threading.RLock()
        self.generation = 0
        self.weights_generation = 0
        self.checkpoint_due = False
        self.quiesce: list[Callable[[], None]] = []
        self._pending: dict[str, str | None] = {}

    @contextmanager
    def rewinding(self) -> Iterator[None]:
        """Hold the lock, with every hot-load in flight finished: serve the clean adapter inside, then `request`."""
        with self.lock:
            for wait in self.quiesce:
                wait()
            yield

    def request(self, adapter: str, path: str | Path | None, forget: bool = True) -> int:
        """Ask the trainer to load `path` into `adapter` (None: fresh LoRA weights, the base model); with `forget`
        nothing published from the older weights is served from now on (without it, `publish.gate.rebase_after`'s
        rebase: adapters already written stay candidates). Returns the generation."""
        with self.lock:
            self.generation += int(forget)
            self._pending[adapter] = None if path is None else str(path)
            self._record(adapter, {"path": self._pending[adapter], "done": False})
            return self.generation

    def pending_record(self, adapter: str) -> dict[str, Any] | None:
        """`adapter`'s rewind that no checkpoint holds yet (a restart applies it again), else None."""
        if self.layout is None:
            return None
        try:
            record = json.loads(self.layout.adapters(adapter).rewind_record.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and not record.get("done") else None

    def settle(self) -> None:
        """A checkpoint of the rewound weights is on disk: their records are done (a restart resumes from it)."""
        for adapter in sorted(self.applied):
            record = self.pending_record(adapter)
            if record is not None:
                self._record(adapter, {**record, "done": True})
        self.applied.clear()

    def _record(self, adapter: str, record: dict[str, Any]) -> None:
        if self.layout is not None:
            self.layout.adapters(adapter).path.mkdir(parents=True, exist_ok=True)
            write_file_atomically(self.layout.adapters(adapter).rewind_record, json.dumps(record))

    def take(self) -> tuple[dict[str, str | None], int]:
        """The pending requests (cleared) and the generation the weights belong to once they are applied."""
        with self.lock:
            pending, self._pending = self._pending, {}
            return pending, self.generation

    def serve_if_current(self, generation: int, serve: Callable[[], Any]) -> bool:
        """Run `serve()` unless a rewind came after weights of `generation` were written; False when refused."""
        with self.lock:
            if generation != self.generation:
                return False
            serve()
            return True


class RewindCallback(L.Callback):
    """Applies `Rewind` requests to the trainer's weights (before a step starts and before a step is published)
    and marks a claimed batch that holds a forgotten sample (the module then takes no optimizer step on it).

    Place it before the publisher: its `on_train_batch_end` runs first, so a step in progress when the rewind was
    asked publishes the clean weights, not its own update.
    """

    def __init__(self, rewind: Rewind, store_path: str | Path) -> None:
        self.rewind, self.store_path = rewind, store_path
        self._store: Any = None  # opened on the trainer's thread at the first batch
        self.applied: list[tuple[int, str, str | None]] = []  # (step, adapter, path or None for the base model)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A rewind asked before a restart that no checkpoint holds yet: the resumed weights are the old ones."""
        pending = {}
        if trainer.is_global_zero:
            for adapter in pl_module.policy.adapter_names:  # type: ignore[union-attr]
                record = self.rewind.pending_record(adapter)
                if record is None:
                    continue
                path = record.get("path")
                if path is not None and not Path(path).is_dir():  # pruned since: the base model is clean too
                    log.warning("Rewind: %s is gone; adapter %r goes back to the base model instead", path, adapter)
                    path = None
                pending[adapter] = path
        self._restore(trainer, pl_module, trainer.strategy.broadcast(pending, src=0))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._apply(trainer, pl_module)
        ids = batch.get("sample_ids") if isinstance(batch, dict) else None
        if ids is not None and ids.numel():
            if self._store is None:
                self._store = open_store(self.store_path)
            gone = self._store.missing(ids.tolist())
            if gone:
                batch["forgotten"] = True  # OnlineRLModule: no optimizer step (`train/skipped_forgotten`)
                log.warning("Step %d: samples %s were forgotten after they were claimed: the step is dropped",
                            trainer.global_step, sorted(gone)[:10])  # fmt: skip

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._apply(trainer, pl_module)

    def _apply(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pending, generation = self.rewind.take() if trainer.is_global_zero else ({}, 0)
        pending, generation = trainer.strategy.broadcast((pending, generation), src=0)  # every rank alike
        self._restore(trainer, pl_module, pending)
        self.rewind.weights_generation = generation

    def _restore(self, trainer: L.Trainer, pl_module: L.LightningModule, pending: dict[str, str | None]) -> None:
        policy: Any = pl_module.policy  # metaclaw.modules.policy.LoraPolicy
        for adapter, path in pending.items():
            policy.restore_adapter(adapter, path)
            drop_moments(trainer.optimizers, policy.adapter_parameters(adapter))
            self.applied.append((trainer.global_step, adapter, path))
            self.rewind.applied.add(adapter)
            log.warning("Rewind: adapter %r is back to %s at step %d, with fresh optimizer moments",
                        adapter, path or "the base model (fresh LoRA weights)", trainer.global_step)  # fmt: skip
        if pending:
            self.rewind.checkpoint_due = True  # the checkpoint on disk holds the weights left behind
