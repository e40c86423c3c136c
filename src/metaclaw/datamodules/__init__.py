"""The durable sample store and the streaming DataModule that trains from it."""

from metaclaw.datamodules.rollout import RolloutDataModule, StreamingSampleDataset, collate_samples
from metaclaw.datamodules.store import Sample, SampleStore, SampleValidationError

__all__ = [
    "RolloutDataModule",
    "Sample",
    "SampleStore",
    "SampleValidationError",
    "StreamingSampleDataset",
    "collate_samples",
]
