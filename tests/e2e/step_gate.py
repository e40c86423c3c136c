"""A Lightning callback the process tests inject (`+callbacks.gate=...`) to hold a step open on purpose."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L


class HoldStep(L.Callback):
    """At optimizer step `step`: touch `marker`, then sleep `seconds` inside the step (a signal can land there)."""

    def __init__(self, marker: str, step: int = 1, seconds: float = 30.0) -> None:
        self.marker, self.step, self.seconds = Path(marker), step, seconds

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            self.marker.write_text(str(self.step))
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                time.sleep(0.1)
