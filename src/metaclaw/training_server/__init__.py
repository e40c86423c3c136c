"""Seed 000's remote training API (`python serve.py app=training_server`): MetaClaw's `rl.backend: remote`.

LoRA sessions on one base model, trained by externally driven `forward_backward` / `optim_step` calls with the
same policy and loss modules as `train.py`, sampled with the training model (`hf`) or vLLM with hot-swap.
"""

from __future__ import annotations

from metaclaw.training_server.main import run

__all__ = ["run"]
