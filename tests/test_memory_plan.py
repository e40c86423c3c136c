"""Issue 41 (3): the memory plan at start, on fake cards (24, 40, 80 GB): only the GPU memory query is replaced."""

from __future__ import annotations

import json
import logging

import pytest

from metaclaw import memory_plan
from metaclaw.devices import DevicePlanError, resolve_devices
from metaclaw.memory_plan import GIB, Shape, check_memory, model_shape
from tests.test_configs import _compose

CARD = ["method=combine", "model=qwen3_8b", "devices.train=[0,1]"]  # the card's command
SPLIT = ["method=combine", "model=qwen3_8b", "devices.train=[0]", "devices.infer=[1]"]


def cards(monkeypatch: pytest.MonkeyPatch, gb: float) -> list[int]:
    """Every GPU has `gb` GB; the devices asked are recorded."""
    asked: list[int] = []

    def total(device: int) -> int:
        asked.append(device)
        return int(gb * 1e9)

    monkeypatch.setattr(memory_plan, "gpu_total_memory", total)
    return asked


def planned(overrides: list[str], tmp_path, gpus: int = 2):
    cfg = _compose("train", overrides, tmp_path)
    return cfg, resolve_devices(cfg, gpu_count=gpus, vllm_available=True)


def test_qwen3_shapes_give_their_published_sizes(tmp_path):
    for name, billions in (("qwen3_8b", 8.19), ("qwen3_4b", 4.02)):  # Qwen's model cards: 8.2B and 4.0B
        cfg = _compose("train", [f"model={name}"], tmp_path)
        shape = model_shape(cfg.model)
        assert shape is not None and shape.params() / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.parametrize("gb", [24, 40])
def test_the_cards_command_on_a_24_or_40_gb_card_is_refused_with_its_numbers(monkeypatch, tmp_path, gb):
    asked = cards(monkeypatch, gb)
    cfg, plan = planned(CARD, tmp_path)
    with pytest.raises(DevicePlanError) as err:
        check_memory(cfg, plan)
    text = str(err.value)
    assert "cuda:0 serve (vLLM): needs 19.7 GiB (weights 15.3" in text  # Qwen3-8B bf16 + KV + LoRA slots + headroom
    assert f"of {gb * 1e9 * 0.3 / GIB:.1f} GiB" in text  # 30% of the card: devices.colocate_infer_memory
    assert "devices.colocate_infer_memory" in text and "model.max_seq_len" in text
    assert asked  # the query was made


def test_the_cards_command_on_80_gb_cards_turns_checkpointing_on_and_says_why(monkeypatch, tmp_path, caplog):
    cards(monkeypatch, 80)
    cfg, plan = planned(CARD, tmp_path)
    assert cfg.policy.gradient_checkpointing is False  # the card's config
    with caplog.at_level(logging.INFO, logger="metaclaw.memory_plan"):
        needs = check_memory(cfg, plan)
    assert cfg.policy.gradient_checkpointing is True
    assert "gradient_checkpointing turned on: without it cuda:0 train (beside vLLM): needs 63.2 GiB" in caplog.text
    roles = {(n.device, n.role) for n in needs}
    assert roles == {(0, "serve (vLLM)"), (0, "train (beside vLLM)"), (1, "train")}
    assert all(n.total <= n.budget for n in needs)
    train0 = next(n for n in needs if n.role == "train (beside vLLM)")
    assert train0.budget == pytest.approx(80e9 * 0.7, rel=1e-6)  # what vLLM's 30% leaves


def test_a_gpu_of_its_own_for_serving_needs_no_checkpointing_on_80_gb(monkeypatch, tmp_path):
    cards(monkeypatch, 80)
    cfg, plan = planned(SPLIT, tmp_path)
    needs = check_memory(cfg, plan)
    assert cfg.policy.gradient_checkpointing is False
    serve = next(n for n in needs if n.role == "serve (vLLM)")
    assert serve.budget == pytest.approx(80e9 * 0.85)  # backend.gpu_memory_utilization on its own GPU


def test_training_that_cannot_fit_even_with_checkpointing_is_refused(monkeypatch, tmp_path):
    cards(monkeypatch, 80)
    cfg, plan = planned([*SPLIT, "model.max_seq_len=262144"], tmp_path)  # vLLM's share holds its KV cache
    with pytest.raises(DevicePlanError, match="even with gradient checkpointing, at model.max_seq_len=262144"):
        check_memory(cfg, plan)


def test_fsdp_shards_weights_and_adapter_state(monkeypatch, tmp_path):
    cards(monkeypatch, 80)
    ddp, ddp_plan = planned(["model=qwen3_8b", "devices.train=[0,1]", "devices.infer=[2]"], tmp_path, gpus=3)
    fsdp, fsdp_plan = planned(["model=qwen3_8b", "devices.train=[0,1]", "devices.infer=[2]",
                               "devices.strategy=fsdp"], tmp_path, gpus=3)  # fmt: skip
    weights = [next(n for n in check_memory(c, p) if n.role == "train").parts["weights"]
               for c, p in ((ddp, ddp_plan), (fsdp, fsdp_plan))]  # fmt: skip
    assert weights[1] == pytest.approx(weights[0] / 2)


def test_a_cpu_plan_asks_no_gpu(monkeypatch, tmp_path):
    asked = cards(monkeypatch, 24)
    cfg = _compose("train", ["model=qwen3_8b"], tmp_path)
    plan = resolve_devices(cfg, gpu_count=0, vllm_available=False)
    assert check_memory(cfg, plan) == [] and asked == []


def test_a_local_config_json_is_read_before_the_yaml_numbers(tmp_path):
    local = tmp_path / "Qwen3-8B"
    local.mkdir()
    shape = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}  # fmt: skip
    (local / "config.json").write_text(json.dumps(shape))
    cfg = _compose("train", ["model=qwen3_8b", f"model.path={local}"], tmp_path)
    assert model_shape(cfg.model) == Shape.of(shape)  # Qwen3-0.6B's numbers, not the 8B's yaml


def test_activations_with_checkpointing_are_a_fraction_of_those_without():
    shape = Shape(4096, 12288, 36, 32, 8, 151936, head_dim=128)
    full, ckpt = shape.activations_per_token(False, 2), shape.activations_per_token(True, 2)
    assert full == 36 * (4 * 4096 + 3 * 4096 + 3 * 1024 + 4 * 12288) * 2  # the tensors one layer keeps, per token
    assert ckpt == 36 * 4096 * 2 + full // 36
