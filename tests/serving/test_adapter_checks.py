"""Issue 41 (fast, no vLLM): what `backend=vllm` checks before vLLM sees an adapter (vLLM issue 34186), and how it
is started (the command, the flags)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from safetensors.torch import load_file, save_file

from metaclaw.serving.engines import AdapterError
from metaclaw.serving.engines.adapter_checks import check_module_names, check_targets, model_weight_names
from metaclaw.serving.engines.vllm_server import VLLMNotFound, server_flags, vllm_command


@pytest.fixture(scope="module")
def names(tiny_spec):
    return model_weight_names(tiny_spec.local_dir())


def test_an_adapter_saved_from_the_model_passes(fixed_adapter, names):
    check_module_names(fixed_adapter, names)
    check_targets(fixed_adapter, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def test_module_names_under_another_prefix_are_refused_naming_them(fixed_adapter, names, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(fixed_adapter, wrong)
    weights = load_file(str(wrong / "adapter_model.safetensors"))
    renamed = {k.replace("model.model.layers", "model.model.language_model.layers"): v for k, v in weights.items()}
    save_file(renamed, str(wrong / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"34186") as err:
        check_module_names(wrong, names)
    assert "model.language_model.layers.0." in str(err.value) and "model.layers" in str(err.value)


def test_an_adapter_of_unwrapped_modules_is_refused(fixed_adapter, tmp_path):
    wide = tmp_path / "wide"
    shutil.copytree(fixed_adapter, wide)
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(AdapterError, match=r"\['lm_head'\]"):
        check_targets(wide, ["q_proj", "v_proj"])


def test_vllm_comes_from_its_own_environment_or_the_command_given(tmp_path):
    with pytest.raises(VLLMNotFound, match=r"setup_vllm_cpu\.sh"):
        vllm_command(None, tmp_path / "none")
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "bin" / "python").symlink_to(sys.executable)
    assert vllm_command(None, tmp_path / "env")[1:] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert vllm_command("uv tool run vllm serve") == ["uv", "tool", "run", "vllm", "serve"]
    with pytest.raises(VLLMNotFound, match="not an executable"):
        vllm_command([str(tmp_path / "nowhere" / "vllm"), "serve"])


def test_the_flags_training_needs_are_always_set():
    flags = server_flags("/m", "qwen3-8b", 8192, 8123, max_lora_rank=32, max_loras=3, lora_target_modules=["q_proj"])
    joined = " ".join(flags)
    for part in ("--served-model-name qwen3-8b", "--max-model-len 8192", "--host 127.0.0.1", "--port 8123",
                 "--enable-lora", "--max-lora-rank 32", "--max-loras 3", "--lora-target-modules q_proj",
                 "--logprobs-mode processed_logprobs", "--max-logprobs -1"):  # fmt: skip
        assert part in joined
