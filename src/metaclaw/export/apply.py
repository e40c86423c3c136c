"""`ApplyImport`: the trainer starts from an adapter `python -m metaclaw import` installed (docs/export.md).

At train start (after the publisher served the checkpoint's adapter), every adapter with a pending `import.json`
gets the imported weights, fresh optimizer moments for them, and is served. The import counts as applied once a
checkpoint after it exists: a restart before the first publish applies it again, a later restart resumes from
the checkpoint (which then holds the imported weights trained on).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L

from metaclaw.agents import AgentProfiles
from metaclaw.export.runs import write_json_atomically
from metaclaw.modules.agent_state import drop_moments
from metaclaw.runfiles.layout import RunLayout

__all__ = ["ApplyImport"]

log = logging.getLogger(__name__)


class ApplyImport(L.Callback):
    """Load pending imported adapters into the policy at train start and serve them.

    Args:
        run_dir: the run directory.
        profiles: the run's agents (where each adapter's directory is).
        publisher: the `AdapterPublisher` whose loaders serve each adapter.
    """

    def __init__(self, run_dir: str | Path, profiles: AgentProfiles, publisher: Any) -> None:
        self.run_dir, self.profiles, self.publisher = Path(run_dir), profiles, publisher
        self.applied: list[str] = []

    def _loader(self, adapter: str) -> Any:
        agents = getattr(self.publisher, "agents", None)
        return agents.parts[adapter][1] if agents is not None else self.publisher.server

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        for adapter in pl_module.policy.adapter_names:
            pending = RunLayout(self.run_dir).adapters(adapter).import_record
            if not pending.is_file():
                continue
            record = json.loads(pending.read_text())
            done = record.get("applied_at_step")
            if done is not None and step > done:  # a checkpoint after the import already holds its weights
                continue
            path = Path(record["path"])
            pl_module.policy.load_adapter(path, adapter)
            drop_moments(trainer.optimizers, pl_module.policy.adapter_parameters(adapter))  # old weights' moments
            self.applied.append(adapter)
            if trainer.is_global_zero:
                record["applied_at_step"] = step
                write_json_atomically(pending, record)
                self._loader(adapter).serve(path, step)
                log.warning("Imported adapter %s loaded into %r at step %d and served; training goes on from it",
                            path, adapter, step)  # fmt: skip
