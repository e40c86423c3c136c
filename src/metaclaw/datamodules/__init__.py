"""The durable sample store and the streaming DataModule that trains from it.

The DataModule (Lightning, torch) is imported lazily, so the proxy can use the store without loading them.
"""

from metaclaw.datamodules.store import BACKLOG_POLICIES, BacklogFull, Sample, SampleStore, SampleValidationError

__all__ = [
    "BACKLOG_POLICIES",
    "BacklogFull",
    "RolloutDataModule",
    "Sample",
    "SampleStore",
    "SampleValidationError",
    "StreamingSampleDataset",
    "collate_samples",
]


def __getattr__(name: str):
    if name in ("RolloutDataModule", "StreamingSampleDataset", "collate_samples"):
        from metaclaw.datamodules import rollout

        return getattr(rollout, name)
    raise AttributeError(f"module 'metaclaw.datamodules' has no attribute {name!r}")
