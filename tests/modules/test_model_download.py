"""Issue 41 (3): a hub model is loaded from the local cache or refused with the `hf download` step; never fetched."""

from __future__ import annotations

import json

import pytest

from metaclaw.memory_plan import Shape, model_shape
from metaclaw.modules.loading import ModelSpec


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache of this test's own."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_model_not_on_this_machine_is_refused_with_the_download_step(hf_cache):
    spec = ModelSpec(name="qwen3-8b", path="Qwen/Qwen3-8B")
    with pytest.raises(FileNotFoundError) as err:
        spec.local_dir()
    message = str(err.value)
    assert "\n" not in message  # one line
    assert "hf download Qwen/Qwen3-8B --local-dir ~/models/Qwen3-8B  (then model.path=~/models/Qwen3-8B)" in message


def test_a_cached_hub_model_loads_from_its_snapshot_and_the_plan_reads_its_config(hf_cache):
    snapshot = hf_cache / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (hf_cache / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (hf_cache / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("0123abcd")
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 1000}  # fmt: skip
    (snapshot / "config.json").write_text(json.dumps(config))
    assert ModelSpec(name="qwen3-8b", path="Qwen/Qwen3-8B").local_dir() == snapshot
    assert model_shape({"path": "Qwen/Qwen3-8B", "shape": {"hidden_size": 1}}) == Shape.of(config)
