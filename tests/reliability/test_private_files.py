"""Issue 31, finding 10: run files are private (0700 folders, 0600 files), keys stay out of the run's Hydra dumps,
the W&B run name and W&B's metadata, `latest.json` is written atomically, and `atomic.py` makes renames durable."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from metaclaw.atomic import write_dir_atomically
from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.modules.adapter_writer import AdapterWriter
from metaclaw.runfiles import protect_run_dir, redact_hydra_dumps, secret_overrides
from tests.conftest import REPO

SECRET = "sk-planted-secret-0123456789"


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths `os.fsync` was called on (files and directories), in order."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_a_renamed_directory_is_made_durable_by_fsyncing_its_parent(tmp_path: Path, fsynced: list[str]) -> None:
    target = tmp_path / "adapters" / "step-000001"
    write_dir_atomically(target, lambda d: (d / "adapter_model.safetensors").write_bytes(b"x"))
    assert fsynced[-1] == str(tmp_path / "adapters")  # after the rename: old main never fsynced a directory


def test_latest_json_is_written_atomically_and_privately(tmp_path: Path, fsynced: list[str]) -> None:
    writer = AdapterWriter(tmp_path)
    (tmp_path / "adapters").mkdir()
    writer.write_latest(3, tmp_path / "adapters" / "step-000003", "policy", [[1.0, 2.0]])
    latest = tmp_path / "adapters" / "latest.json"
    assert writer.read_latest()["version"] == 3
    assert any(Path(p).name.startswith(".latest.json-") for p in fsynced)  # a temp file, fsynced, renamed over it
    assert fsynced[-1] == str(tmp_path / "adapters")
    assert stat.S_IMODE(latest.stat().st_mode) == 0o600
    assert [p.name for p in latest.parent.iterdir()] == ["latest.json"]  # no temp file left


def test_protect_run_dir_makes_existing_files_private(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        (tmp_path / "run" / "checkpoints").mkdir(parents=True)
        (tmp_path / "run" / "samples.sqlite").write_text("conversations")
        (tmp_path / "run" / "checkpoints" / "last.ckpt").write_text("weights")
        protect_run_dir(tmp_path / "run")
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "run", *(tmp_path / "run").rglob("*")]}
        assert modes == {"run": 0o700, "checkpoints": 0o700, "samples.sqlite": 0o600, "last.ckpt": 0o600}
        (tmp_path / "run" / "new.log").write_text("later")  # what the run writes afterwards: private too
        assert stat.S_IMODE((tmp_path / "run" / "new.log").stat().st_mode) == 0o600
    finally:
        os.umask(umask)


def test_keys_given_as_overrides_leave_the_hydra_dumps(tmp_path: Path) -> None:
    overrides = ["model=tiny", f"serving.api_key={SECRET}", f"+judge.token='{SECRET}x'", "rollout.proxy.port=1"]
    assert secret_overrides(overrides) == {"serving.api_key": SECRET, "judge.token": f"{SECRET}x"}
    (tmp_path / "overrides.yaml").write_text("\n".join(f"- {o}" for o in overrides))
    (tmp_path / "config.yaml").write_text(f"serving:\n  api_key: {SECRET}\n")
    assert len(redact_hydra_dumps(tmp_path, secret_overrides(overrides))) == 2
    assert all(SECRET not in p.read_text() for p in tmp_path.iterdir())
    assert "rollout.proxy.port=1" in (tmp_path / "overrides.yaml").read_text()


def _key_fields(node, path: str = "") -> list[str]:
    out = []
    if OmegaConf.is_dict(node):
        for k in node:
            if not (path == "" and k == "hydra"):
                out += _key_fields(node._get_node(k), f"{path}.{k}" if path else str(k))
    return out + ([path] if path.endswith("api_key") else [])


@pytest.mark.parametrize(("config", "extra"), [("train", ["rollout=proxy", "judge=llm", "logger=wandb"]),
                                                ("serve", ["app=training_server"])])  # fmt: skip
def test_the_wandb_run_name_never_holds_a_key(config: str, extra: list[str]) -> None:
    """`name: ${hydra:job.override_dirname}`: every key field of the config is excluded from it."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        plain = compose(config, overrides=extra, return_hydra_config=True)
        keys = _key_fields(plain)
        assert keys and set(keys) <= set(plain.hydra.job.config.override_dirname.exclude_keys)
        cfg = compose(config, overrides=[*extra, "serve.port=8123", *(f"{k}={SECRET}" for k in keys)],
                      return_hydra_config=True)  # fmt: skip
    assert SECRET not in cfg.hydra.job.override_dirname and "serve.port=8123" in cfg.hydra.job.override_dirname


@pytest.mark.slow
def test_a_real_run_is_private_and_holds_no_key_it_was_given(tmp_path: Path) -> None:
    """`train.py` on the tiny model with W&B (offline) and a key on its command line."""
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO / "src")}
    env.pop("WANDB__DISABLE_META", None)
    out = subprocess.run([sys.executable, "train.py", "model=tiny", "rollout=store", "trainer.max_steps=1",
                          "logger=wandb", f"serving.api_key={SECRET}", f"hydra.run.dir={run}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "serving.api_key given on the command line" in out.stdout + out.stderr
    paths = [run, *run.rglob("*")]
    assert any(p.name == "samples.sqlite" for p in paths) and any(p.name == "last.ckpt" for p in paths)
    loose = [f"{p} {oct(stat.S_IMODE(p.lstat().st_mode))}" for p in paths if not p.is_symlink()
             and stat.S_IMODE(p.lstat().st_mode) != (0o700 if p.is_dir() else 0o600)]  # fmt: skip
    assert loose == []
    leaks = [str(p) for p in paths if p.is_file() and not p.is_symlink() and SECRET.encode() in p.read_bytes()]
    assert leaks == []  # old main: .hydra/overrides.yaml, .hydra/config.yaml, .hydra/hydra.yaml, the W&B run file
