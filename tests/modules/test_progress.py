"""The progress bar says what the online loop is doing: budget, steps, samples, held-out compliance, backlog."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from metaclaw.evaluation import LiveEvaluator
from metaclaw.modules.progress import LoopProgressBar


def test_the_bar_shows_steps_samples_last_heldout_compliance_and_backlog(tmp_path):
    live = LiveEvaluator(None, tmp_path, base_model="base")
    live.records.results = [
        {"step": 0, "agent_id": "default", "compliance": 0.25, "ci_low": 0.13, "ci_high": 0.42},
        {"step": 8, "agent_id": "default", "compliance": 0.5, "ci_low": 0.34, "ci_high": 0.66},
        {"step": 8, "agent_id": "alice", "compliance": 0.9},
    ]
    trainer = SimpleNamespace(
        global_step=8, callbacks=[live], progress_bar_metrics={"rollout/backlog": 3.0, "loss/total": 0.25}
    )
    bar = LoopProgressBar()
    bar.on_train_batch_end(trainer, None, None, {"mask": torch.ones(4, 7)}, 0)  # no tqdm bar yet: counts only
    bar.on_train_batch_end(trainer, None, None, {"mask": torch.ones(4, 7)}, 1)
    assert bar.get_metrics(trainer, None) == {
        "step": 8, "samples": 8, "held-out": "50% [34-66] @v8", "backlog": 3, "loss": "0.25",
    }  # fmt: skip
    trainer.progress_bar_metrics["train/publish_failures"] = 2.0
    assert bar.get_metrics(trainer, None)["publish_failures"] == 2
