"""`ServedAnchor`: the KL term's reference follows the adapter the user is served (`kl.reference=served`).

The served pointer (`adapters/.../latest.json`, `runfiles.layout`) is the one record of what each agent is served:
the gate writes it when it lets a candidate through, a rollback (`python -m metaclaw rollback`, the regression
watch) and an import when they serve another adapter, and a restart serves what it names. Before each step this
callback reads the pointer of the batch's adapter and, when it names another adapter than the anchor holds, loads
that adapter's weights as the policy's anchor (`LoraPolicy.set_anchor`). No pointer, or one whose folder is gone:
the base model. Under FSDP (sharded adapter weights) the anchor is refused once, loudly, and the base model stays
the reference.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L

from metaclaw.runfiles.layout import RunLayout

log = logging.getLogger(__name__)


class ServedAnchor(L.Callback):
    """Keeps each adapter's KL anchor on the adapter its agent is served (read from the served pointer)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.layout = RunLayout(run_dir)
        self.anchored: dict[str, str | None] = {}  # adapter -> the served path its anchor holds (None: base)
        self.changes: list[tuple[int, str, str | None]] = []  # (step, adapter, path): every anchor move
        self.refused = False

    def served_path(self, adapter: str) -> str | None:
        """The folder `adapter`'s served pointer names, None for the base model (no pointer, or its folder gone)."""
        info = self.layout.adapters(adapter).read_latest() or {}
        path = info.get("path")
        return str(path) if path and Path(str(path)).is_dir() else None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.refused:
            return
        adapter = batch.get("adapter", "default") if isinstance(batch, dict) else "default"
        path = self.served_path(adapter) if trainer.is_global_zero else None
        path = trainer.strategy.broadcast(path, src=0)  # every rank anchors alike
        if adapter in self.anchored and self.anchored[adapter] == path:
            return
        policy: Any = pl_module.policy  # metaclaw.modules.policy.LoraPolicy
        try:
            policy.set_anchor(adapter, path)
        except NotImplementedError as e:
            self.refused = True
            log.warning("KL reference: %s. The KL term pulls toward the BASE model for the rest of this run.", e)
            return
        except (OSError, ValueError) as e:  # pruned or torn between the read and the load: the next step tries again
            log.warning("KL reference: cannot read the served adapter %s of %r (%r): the anchor stays as it was",
                        path, adapter, e)  # fmt: skip
            return
        self.anchored[adapter] = path
        self.changes.append((trainer.global_step, adapter, path))
        log.info("KL reference of adapter %r: %s (step %d)", adapter, path or "the base model", trainer.global_step)
