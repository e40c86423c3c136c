"""The streaming DataModule that trains from the sample store (`metaclaw.store`), and the seed filler.

The DataModule (Lightning, torch) is imported lazily, so `import metaclaw.datamodules` stays light.
"""

__all__ = ["RolloutDataModule", "StreamingSampleDataset", "collate_samples"]


def __getattr__(name: str):
    if name in ("RolloutDataModule", "StreamingSampleDataset", "collate_samples"):
        from metaclaw.datamodules import rollout

        return getattr(rollout, name)
    raise AttributeError(f"module 'metaclaw.datamodules' has no attribute {name!r}")
