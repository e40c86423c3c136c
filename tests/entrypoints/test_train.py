"""`train.py` end to end on the tiny model: adapters written, LoRA-only updates, resume, DDP, multirun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.modules.policy import LoraPolicy
from metaclaw.store import SampleStore

REPO = Path(__file__).resolve().parents[2]
register_resolvers()


def compose_train(run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "model=tiny",
                "rollout=store",
                "logger=csv",
                f"hydra.run.dir={run_dir}",
                f"run_dir={run_dir}",
                *overrides,
            ],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def run_cli(*args: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_cli_tiny_run_leaves_adapters(tmp_path):
    out = run_cli("model=tiny", "rollout=store", "trainer.max_steps=3", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    for step in (1, 2, 3):
        assert (tmp_path / "adapters" / f"step-{step:06d}" / "adapter_model.safetensors").exists()
    assert (tmp_path / "samples.sqlite").exists() and (tmp_path / "checkpoints" / "last.ckpt").exists()
    metrics = (tmp_path / "csv" / "metrics.csv").read_text()
    assert "loss/total" in metrics and "rollout/reward_mean" in metrics


def test_train_updates_lora_only_and_adapter_reproduces_logits(tmp_path, tiny_spec):
    from metaclaw.training import train

    metrics, objs = train(compose_train(tmp_path, "trainer.max_steps=2", "optimizer.lr=1e-2"))
    assert metrics["train/global_step"] == 2 and torch.isfinite(torch.tensor(metrics["loss/total"]))
    policy = objs["module"].policy
    trained_b = [p for n, p in policy.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in trained_b)  # PEFT initialises B to zero: training moved it
    base = tiny_spec.load_model().state_dict()
    for name, p in policy.model.base_model.model.named_parameters():
        if "lora_" not in name:
            key = name.replace(".base_layer", "")
            assert torch.equal(p.detach(), base[key]), f"base weight {name} changed"
    reloaded = LoraPolicy(tiny_spec.load_model(), rank=16, alpha=32)
    reloaded.load_adapter(tmp_path / "adapters" / "step-000002")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    policy.eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(ids, torch.ones_like(ids)), policy(ids, torch.ones_like(ids)), atol=1e-5)


def test_resume_trains_every_sample_once(tmp_path):
    from metaclaw.training import train

    train(compose_train(tmp_path, "trainer.max_steps=2", "data.batch_size=2"))
    store = SampleStore(tmp_path / "samples.sqlite")
    assert store.counts()["consumed"] == 4
    metrics, _ = train(compose_train(tmp_path, "trainer.max_steps=5", "data.batch_size=2"))
    assert metrics["train/global_step"] == 5
    consumed = store.select("consumed")
    assert len(consumed) == 10 and len({s.id for s in consumed}) == 10
    assert sorted({s.claimed_step for s in consumed}) == [0, 1, 2, 3, 4]
    assert store.counts()["claimed"] == 0


@pytest.mark.parametrize("method", ["opd", "combine"])
def test_methods_complete(tmp_path, method):
    from metaclaw.training import train

    metrics, objs = train(compose_train(tmp_path, f"method={method}", "trainer.max_steps=1"))
    assert metrics["train/global_step"] == 1
    store = objs["store"]
    if method == "opd":  # seed 002: turns without a hint are dropped
        assert store.counts()["dropped"] > 0
        assert all(s.teacher_logprobs is not None for s in store.select("consumed"))


@pytest.mark.slow  # two training processes (~18 s): `make test-slow`, with the other multi-process DDP tests
def test_cpu_ddp_two_processes(tmp_path):
    out = run_cli(
        "model=tiny",
        "rollout=store",
        "logger=none",
        "devices.cpu_processes=2",
        "data.batch_size=4",
        "trainer.max_steps=3",
        f"hydra.run.dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    store = SampleStore(tmp_path / "samples.sqlite")
    consumed = store.select("consumed")
    assert len(consumed) == 12 and len({s.id for s in consumed}) == 12  # 3 steps x 4 samples, none twice
    latest = json.loads((tmp_path / "adapters" / "latest.json").read_text())
    fingerprints = latest["rank_fingerprints"]
    assert len(fingerprints) == 2 and fingerprints[0] == fingerprints[1]


def test_multirun_one_wandb_run_per_job(tmp_path):
    out = run_cli(
        "-m",
        "model=tiny",
        "rollout=store",
        "logger=wandb",
        "trainer.max_steps=1",
        "method=rl,combine",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for job in ("0", "1"):
        runs = list((tmp_path / job / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, f"job {job}: {runs}"
        assert (tmp_path / job / "adapters" / "step-000001" / "adapter_model.safetensors").exists()


def test_fit_ends_when_the_stream_goes_idle(tmp_path):
    from metaclaw.training import train

    metrics, objs = train(compose_train(tmp_path, "trainer.max_steps=100", "data.wait_timeout_s=0.5"))
    assert metrics["train/global_step"] == 4  # 16 shipped samples, 4 per step, then no more arrive
    assert objs["store"].counts()["consumed"] == 16
