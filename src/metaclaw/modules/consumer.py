"""`SampleConsumer`: settles the store's claims against checkpoints (the store's crash-safety contract).

A sample is consumed only once a checkpoint covering the step that trained on it exists; what a finished or
interrupted run claimed but no checkpoint covers goes back to `ready`.
"""

from __future__ import annotations

from pathlib import Path

from metaclaw.store import open_store


class SampleConsumer:
    """Marks the samples of checkpointed steps consumed, and hands back what no checkpoint covers.

    Args:
        store_path: the sample store whose claims a checkpoint settles.
    """

    def __init__(self, store_path: str | Path) -> None:
        self.store_path = store_path

    def consume_through(self, step: int) -> None:
        """The checkpoint of `step` is on disk: every sample claimed by a step up to it is consumed."""
        open_store(self.store_path).mark_consumed(step)

    def settle(self, step: int) -> None:
        """Consume what the checkpoint of `step` covers; claims past it (a prefetched batch) go back to ready."""
        open_store(self.store_path).reconcile(step)
