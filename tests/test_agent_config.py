"""The `agents` config node: profiles compose, fields that cannot work together are refused naming them, and
vLLM's `max_loras` is sized for every agent's adapter."""

from __future__ import annotations

import pytest

from metaclaw.agents import AgentProfiles, size_max_loras
from metaclaw.config import ConfigError, trainer_device_kwargs, validate_train_config
from metaclaw.devices import resolve_devices
from tests.entrypoints.test_train import compose_train


def test_default_config_has_one_default_profile_in_the_runs_mode(tmp_path):
    cfg = compose_train(tmp_path)
    profiles = AgentProfiles.from_config(cfg)
    assert not profiles.many and profiles.default.mode == "rl" and profiles.default.lora_name == "policy"
    assert AgentProfiles.from_config(compose_train(tmp_path, "mode=skills_only")).default.mode == "skills_only"


def test_vllm_max_loras_is_sized_for_every_agent_adapter(tmp_path):
    agents = [f"+agents.a{i}.mode=rl" for i in range(6)]
    cfg = compose_train(tmp_path, "backend=vllm", *agents, "+agents.quiet.mode=skills_only")
    size_max_loras(cfg, AgentProfiles.from_config(cfg))
    assert cfg.backend.max_loras == 8  # default + 6 own adapters + 1 for a swap in flight; skills_only: none
    cfg = compose_train(tmp_path, "backend=vllm", "backend.max_loras=16", *agents)
    size_max_loras(cfg, AgentProfiles.from_config(cfg))
    assert cfg.backend.max_loras == 16  # never lowered


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["+agents.alice.mode=sometimes"], "agents.alice.mode"),
        (["mode=skills_only", "+agents.alice.mode=rl"], "agents.alice.mode=rl"),
        (["+agents.alice.mood=rl"], "agents.alice"),
        (["+agents.alice.mode=rl", "devices.strategy=fsdp"], "devices.strategy=fsdp"),
    ],
)
def test_agent_fields_that_cannot_work_are_refused_naming_them(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate_train_config(compose_train(tmp_path, *overrides))


def test_agent_adapters_with_several_training_processes_run_ddp_that_finds_unused_parameters(tmp_path):
    cfg = compose_train(tmp_path, "+agents.alice.mode=rl", "devices.cpu_processes=2")
    resolve_devices(cfg, gpu_count=0, vllm_available=False)
    validate_train_config(cfg)  # refused before DDP handled adapters that take turns (docs/agents.md)
    assert trainer_device_kwargs(cfg.devices, several_adapters=True)["strategy"] == "ddp_find_unused_parameters_true"
    assert trainer_device_kwargs(cfg.devices)["strategy"] == "ddp"  # one adapter: every parameter is used
    one = compose_train(tmp_path, "+agents.alice.mode=rl")
    resolve_devices(one, gpu_count=0, vllm_available=False)
    assert trainer_device_kwargs(one.devices, several_adapters=True)["strategy"] == "auto"  # one process: no DDP
