"""The device plan is a pure function of (config, visible GPUs, vLLM importable): every rule on CPU, fake counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from metaclaw import devices
from metaclaw.config import trainer_device_kwargs, validate_train_config
from metaclaw.devices import DevicePlanError, plan_devices, resolve_devices, trainer_kwargs
from tests.test_configs import _compose

CARD = ["method=combine", "model=qwen3_8b", "devices.train=[0,1]"]
AUTO = {"train": "auto", "infer": "auto", "precision": "auto", "strategy": "auto", "colocate_infer_memory": 0.3}
VLLM = {"name": "auto", "gpu_memory_utilization": 0.85}


def test_card_command_on_a_four_gpu_host_trains_ddp_and_serves_vllm_on_a_free_gpu(tmp_path):
    cfg = _compose("train", CARD, tmp_path)
    plan = resolve_devices(cfg, gpu_count=4, vllm_available=True)
    assert plan.describe() == "train: DDP on cuda:0,1, bf16-mixed; serve: vLLM on cuda:2"
    assert (cfg.devices.train, cfg.devices.infer, cfg.backend.name) == ([0, 1], [2], "vllm")
    assert cfg.backend.gpu_memory_utilization == 0.85  # a GPU of its own: the backend's setting stands
    validate_train_config(cfg)
    assert trainer_device_kwargs(cfg.devices) == {
        "accelerator": "gpu", "devices": [0, 1], "strategy": "ddp", "precision": "bf16-mixed", "num_nodes": 1,
    }  # fmt: skip


def test_the_plan_picks_the_engine_by_its_target_and_the_factory_builds_it(tmp_path, tiny_spec):
    """backend=auto carries a table of engine constructors; the plan writes the chosen one as `_target_`, which is
    all `EngineFactory` reads (one plug mechanism for engines)."""
    from metaclaw.serving.engines import EngineFactory
    from metaclaw.serving.engines.hf import HFEngine

    gpu = _compose("train", CARD, tmp_path)
    resolve_devices(gpu, gpu_count=4, vllm_available=True)
    assert gpu.backend._target_ == "metaclaw.serving.engines.vllm_http.VLLMServerEngine.from_backend"
    default = _compose("train", ["model=tiny"], tmp_path)
    resolve_devices(default, gpu_count=0, vllm_available=False)
    assert default.backend._target_ == "metaclaw.serving.engines.onnx.OnnxEngine.from_backend"  # the CPU default
    cpu = _compose("train", ["model=tiny", "backend.cpu_engine=hf"], tmp_path)
    resolve_devices(cpu, gpu_count=0, vllm_available=False)
    assert cpu.backend._target_ == "metaclaw.serving.engines.hf.HFEngine.from_backend"
    backend = OmegaConf.to_container(cpu.backend, resolve=True)
    engine = EngineFactory(model=tiny_spec, backend=backend, infer_devices=[])()
    assert isinstance(engine, HFEngine) and engine.max_batch_size == backend["max_batch_size"]
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="max_bach_size"):  # a typo is a config error, not ignored
        EngineFactory(model=tiny_spec, backend={**backend, "max_bach_size": 8})()
    with pytest.raises(ValueError, match="has no _target_"):
        EngineFactory(model=tiny_spec, backend={"name": "auto"})()


def test_card_command_on_a_two_gpu_host_colocates_serving_with_a_memory_split(tmp_path):
    cfg = _compose("train", CARD, tmp_path)
    plan = resolve_devices(cfg, gpu_count=2, vllm_available=True)
    assert plan.colocated and plan.infer == (0,) and plan.backend == "vllm"
    assert cfg.backend.gpu_memory_utilization == pytest.approx(0.3)  # devices.colocate_infer_memory
    assert "colocated with training: 30% of the GPU" in plan.describe()
    assert any("shares cuda:0" in w for w in plan.warnings)


def test_card_command_on_a_cpu_host_names_the_missing_gpu(tmp_path):
    cfg = _compose("train", CARD, tmp_path)
    with pytest.raises(DevicePlanError, match=r"devices\.train=\[0, 1\] names GPU 0, but this host has no GPU"):
        resolve_devices(cfg, gpu_count=0, vllm_available=False)


@pytest.mark.parametrize(
    ("gpus", "vllm", "train", "infer", "backend", "precision"),
    [
        (0, False, (), (), "hf", "32-true"),  # CPU only when there is no GPU
        (0, True, (), (), "hf", "32-true"),  # vllm installed but no GPU: auto stays on HF
        (1, True, (0,), (0,), "vllm", "bf16-mixed"),  # one GPU: colocated
        (2, True, (0,), (1,), "vllm", "bf16-mixed"),  # seed 000's split
        (8, True, (0,), (1,), "vllm", "bf16-mixed"),
        (2, False, (0,), (1,), "hf", "bf16-mixed"),  # GPUs but no vllm: HF, with a warning
    ],
)
def test_auto_rules(gpus, vllm, train, infer, backend, precision, monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: False)  # a CPU without bf16 arithmetic (the next test: with)
    plan = plan_devices(AUTO, VLLM, gpus, vllm)
    assert (plan.train, plan.infer, plan.backend, plan.precision) == (train, infer, backend, precision)
    if gpus and not vllm:
        assert any("vLLM is not found" in w for w in plan.warnings)


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_precision_on_a_cpu_is_bf16_mixed_for_the_quantised_engine_where_the_cores_compute_in_bf16(
    bf16, monkeypatch
):
    """With the ONNX engine: 2.25x fp32's training step on the 2-core EPYC (AVX-512 BF16), 91.6 trained samples a
    minute in the main job against 48.4 (docs/results/2026-11-29-session19.md); a CPU without bf16 keeps fp32. The
    HF engine (the CPU default) keeps fp32 training: its replies are fp32, the on-policy ratio stays exactly 1."""
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: bf16)
    onnx = {**VLLM, "cpu_engine": "onnx"}
    assert plan_devices(AUTO, onnx, 0, False).precision == ("bf16-mixed" if bf16 else "32-true")
    assert plan_devices(AUTO, {"name": "onnx"}, 0, False).precision == ("bf16-mixed" if bf16 else "32-true")
    assert plan_devices(AUTO, VLLM, 0, False).precision == "32-true"  # backend=auto on a CPU: HF, fp32
    assert plan_devices(AUTO, {"name": "hf"}, 0, False).precision == "32-true"
    assert trainer_kwargs({"train": [], "cpu_processes": 1, "precision": "auto"})["precision"] == "32-true"
    assert plan_devices({**AUTO, "precision": "32-true"}, onnx, 0, False).precision == "32-true"  # as given
    assert plan_devices(AUTO, VLLM, 1, True).precision == "bf16-mixed"  # a GPU: bf16 either way


def test_the_bf16_probe_asks_torch_about_this_cpu():
    import torch

    assert devices.cpu_has_bf16() == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def test_explicit_backend_and_devices_win_over_auto(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: False)
    plan = plan_devices({**AUTO, "train": [0, 1], "infer": [2]}, {"name": "hf"}, 4, True)
    assert (plan.backend, plan.infer, plan.strategy) == ("hf", (2,), "ddp")
    cpu = plan_devices({**AUTO, "train": [], "infer": []}, VLLM, 4, True)
    assert (cpu.train, cpu.infer, cpu.backend, cpu.precision) == ((), (), "hf", "32-true")


@pytest.mark.parametrize(
    ("devices", "backend", "gpus", "vllm", "message"),
    [
        ({"infer": [3]}, VLLM, 2, True, r"devices\.infer=\[3\] names GPU 3, but this host has GPUs 0\.\.1"),
        ({"train": [0, 0]}, VLLM, 2, True, r"devices\.train lists a GPU twice"),
        ({"train": "0,1"}, VLLM, 2, True, r"devices\.train must be a list of GPU ids or 'auto'"),
        ({}, {"name": "vllm"}, 1, False, r"backend=vllm needs vLLM, which is not found"),
        ({}, {"name": "tgi"}, 1, False, r"backend must be one of"),
        ({"train": []}, VLLM, 0, False, None),  # fine: CPU
        ({"train": [], "strategy": "fsdp"}, VLLM, 0, False, r"devices\.strategy=fsdp needs GPUs in devices\.train"),
        ({"strategy": "zero9"}, VLLM, 1, False, r"devices\.strategy must be one of"),
        ({"train": [0], "cpu_processes": 2}, VLLM, 1, False, r"devices\.cpu_processes applies only"),
        ({"num_nodes": 0}, VLLM, 1, False, r"devices\.num_nodes must be >= 1"),
    ],
)
def test_impossible_plans_fail_at_start_naming_the_fields(devices, backend, gpus, vllm, message):
    if message is None:
        plan_devices({**AUTO, **devices}, backend, gpus, vllm)
        return
    with pytest.raises(DevicePlanError, match=message):
        plan_devices({**AUTO, **devices}, backend, gpus, vllm)


def test_split_gpu_preset_on_a_one_gpu_host_fails_naming_devices_infer(tmp_path):
    cfg = _compose("train", ["devices=split_gpu"], tmp_path)
    with pytest.raises(DevicePlanError, match=r"devices\.infer=\[1\]"):
        resolve_devices(cfg, gpu_count=1, vllm_available=True)


def test_fsdp_builds_lightnings_strategy_for_lora(tmp_path):
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3MLP

    cfg = _compose("train", ["model=qwen3_4b", "devices.train=[0,1]", "devices.strategy=fsdp",
                             "devices.fsdp.activation_checkpointing=true"], tmp_path)  # fmt: skip
    resolve_devices(cfg, gpu_count=2, vllm_available=True)
    kwargs = trainer_device_kwargs(cfg.devices)
    strategy = kwargs["strategy"]
    assert isinstance(strategy, FSDPStrategy) and kwargs["devices"] == [0, 1]
    assert strategy.kwargs["use_orig_params"] is True  # LoRA: frozen and trainable weights in one flat param
    assert strategy.sharding_strategy.name == "FULL_SHARD" and strategy._state_dict_type == "full"
    layer = Qwen3DecoderLayer(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=32), 0)  # fmt: skip
    wrap = strategy.kwargs["auto_wrap_policy"]
    assert wrap(module=layer, recurse=False, nonwrapped_numel=0)  # one FSDP unit per decoder layer
    assert not wrap(module=Qwen3MLP(layer.mlp.config), recurse=False, nonwrapped_numel=0)
    assert strategy._activation_checkpointing_kwargs  # activation checkpointing per decoder layer


def test_multi_node_config_path(tmp_path):
    """`devices.num_nodes=2` (one train.py per GPU per node under torchrun / SLURM) reaches the Trainer."""
    cfg = _compose("train", ["devices.train=[0,1,2,3]", "devices.num_nodes=2", "data.batch_size=8"], tmp_path)
    plan = resolve_devices(cfg, gpu_count=4, vllm_available=False)
    assert plan.train_processes == 8 and "× 2 nodes" in plan.describe()
    validate_train_config(cfg)
    kwargs = trainer_device_kwargs(cfg.devices)
    assert (kwargs["num_nodes"], kwargs["strategy"], kwargs["devices"]) == (2, "ddp", [0, 1, 2, 3])
    small = _compose("train", ["devices.train=[0,1,2,3]", "devices.num_nodes=2", "data.batch_size=4"], tmp_path)
    resolve_devices(small, gpu_count=4, vllm_available=False)
    with pytest.raises(ValueError, match=r"data\.batch_size \(4\) must be >= the training processes \(8"):
        validate_train_config(small)


def test_serving_and_training_on_one_cpu_split_its_cores_into_thread_budgets(tmp_path):
    """docs/online_loop.md "Training keeps its share": the server train.py starts never takes the trainer's cores."""
    cpu = {**AUTO, "train": [], "infer": []}
    plan = plan_devices(cpu, VLLM, 0, False, cpu_count=2, serves_here=True)
    assert (plan.serve_threads, plan.train_threads) == (1, 1)  # the 2-core box: one core each, none shared
    assert "torch threads: serve 1, train 1" in plan.describe()
    sixteen = plan_devices(cpu, VLLM, 0, False, cpu_count=16, serves_here=True)
    assert (sixteen.serve_threads, sixteen.train_threads) == (8, 8)
    two_ranks = plan_devices({**cpu, "cpu_processes": 2}, VLLM, 0, False, cpu_count=16, serves_here=True)
    assert two_ranks.train_threads == 4  # the cores serve leaves, split over the training processes
    alone = plan_devices(cpu, VLLM, 0, False, cpu_count=2, serves_here=False)  # serve.py alone, or rollout=store
    assert (alone.serve_threads, alone.train_threads) == (None, None)  # torch's default: the whole CPU
    gpu = plan_devices(AUTO, VLLM, 1, True, cpu_count=2, serves_here=True)
    assert (gpu.serve_threads, gpu.train_threads) == (None, None)
    fixed = plan_devices({**cpu, "cpu_threads": {"serve": 3, "train": None}}, VLLM, 0, False, 8, serves_here=True)
    assert (fixed.serve_threads, fixed.train_threads) == (3, None)
    with pytest.raises(DevicePlanError, match=r"devices\.cpu_threads\.serve must be an integer >= 1"):
        plan_devices({**cpu, "cpu_threads": {"serve": 0}}, VLLM, 0, False, 2)
    cfg = _compose("train", ["model=tiny", "rollout=proxy"], tmp_path)  # the live path's composed config
    resolve_devices(cfg, gpu_count=0, vllm_available=False, serves_here=True, cpu_count=2)
    assert OmegaConf.to_container(cfg.devices.cpu_threads) == {"serve": 1, "train": 1}


def test_cpu_ddp_and_single_process_kwargs(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: False)
    assert trainer_kwargs(OmegaConf.create({"train": [], "cpu_processes": 2, "precision": "32-true"}))["strategy"] \
        == "ddp"  # fmt: skip
    one = trainer_kwargs({"train": [], "cpu_processes": 1, "precision": "auto"})
    assert one == {"accelerator": "cpu", "devices": 1, "strategy": "auto", "precision": "32-true", "num_nodes": 1}


@pytest.mark.gpu
def test_fsdp_trains_lora_on_gpus(tmp_path):
    """Two GPUs: FSDP through Lightning trains the adapter (run with -m gpu on a host with >= 2 GPUs)."""
    import subprocess
    import sys

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = subprocess.run([sys.executable, "train.py", "model=tiny", "rollout=store", "devices.train=[0,1]",
                          "devices.strategy=fsdp", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "adapters" / "step-000002" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_fsdp_on_cpu_processes_trains_the_adapter_a_single_process_trains(tmp_path):
    """Issue 11.3: `devices.fsdp` options (LoRA wrap policy, original parameters, full state dict) under Lightning's
    FSDPStrategy, two CPU processes over gloo: the adapters published at every step equal a single process's (the
    global token-mean is the same loss). `tests/entrypoints/fsdp_on_cpu.py` lifts Lightning's CUDA-only guards
    (its docstring names them); it found two bugs the GPU path shares: gradient clipping by norm refused under
    FSDP, and the publisher's adapter export gathering the shards twice."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    repo = Path(__file__).resolve().parents[1]
    common = ["model=tiny", "rollout=store", "logger=none", "data.batch_size=4", "trainer.max_steps=2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    runs = {"single": ["train.py", *common],
            "fsdp": ["tests/entrypoints/fsdp_on_cpu.py", *common, "devices.cpu_processes=2"]}  # fmt: skip
    for name, cmd in runs.items():
        out = subprocess.run([sys.executable, *cmd, f"hydra.run.dir={tmp_path / name}"], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
    for step in ("step-000001", "step-000002"):
        single, fsdp = (load_file(tmp_path / n / "adapters" / step / "adapter_model.safetensors") for n in runs)
        assert single.keys() == fsdp.keys() and len(single) == 28  # 2 layers x 7 projections x (A, B)
        for key, value in single.items():
            assert torch.allclose(fsdp[key], value, atol=1e-4), key
    assert any(v.abs().max() > 0 for k, v in single.items() if "lora_B" in k)  # trained: B starts at zero


def test_a_token_budget_too_small_for_a_full_batch_of_long_samples_is_refused(tmp_path):
    """4 fitted agent prompts of ~7.5k tokens never fit 16,384 tokens: the step waited until they went stale."""
    from metaclaw.config import ConfigError, validate_train_config
    from tests.entrypoints.test_train import compose_train

    cfg = compose_train(tmp_path, "model.max_seq_len=8192", "data.max_tokens=16384", "data.min_batch_size=4")
    with pytest.raises(ConfigError, match=r"data\.max_tokens \(16384\) must be >= data\.min_batch_size \(4\)"):
        validate_train_config(cfg)


def test_backend_vllm_is_found_by_its_own_environment_not_by_an_import(tmp_path):
    """Issue 41: vLLM runs from its own venv (`backend.venv`) or command (`backend.command`); metaclaw's venv never
    imports it. backend=vllm_inprocess is the one that asks for the package."""
    from metaclaw.devices import vllm_installed

    venv = tmp_path / "vllm-env"
    cfg = _compose("train", ["model=tiny", "backend=vllm", f"backend.venv={venv}"], tmp_path)
    with pytest.raises(DevicePlanError, match=r"backend=vllm needs vLLM, which is not found: .*setup_vllm_cpu\.sh"):
        resolve_devices(cfg, gpu_count=0)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    assert resolve_devices(cfg, gpu_count=0).backend == "vllm"
    assert vllm_installed({"command": [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]})
    assert not vllm_installed({"command": ["no-such-vllm-binary", "serve"]})
    inprocess = _compose("train", ["model=tiny", "backend=vllm_inprocess"], tmp_path)
    assert inprocess.backend._target_ == "metaclaw.serving.engines.vllm.VLLMEngine.from_backend"
