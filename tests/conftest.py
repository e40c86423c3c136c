"""Shared fixtures: every test runs offline, on CPU, with the tiny random Qwen3."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_spec():
    from metaclaw.modules.loading import ModelSpec

    return ModelSpec(name="tiny", path="tiny", dtype="float32", max_seq_len=1024)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_spec):
    return tiny_spec.load_tokenizer()


@pytest.fixture
def tiny_policy(tiny_spec):
    from metaclaw.modules.policy import LoraPolicy

    return LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8)
