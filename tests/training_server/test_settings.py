"""The seed's environment variables and the YAML defaults, composed through the real `conf/`."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from metaclaw.config import CONFIG_DIR, ConfigError, register_resolvers
from metaclaw.training_server.settings import ServerSettings, parse_devices

CONF = CONFIG_DIR
ENV = (
    "METACLAW_API_KEY",
    "METACLAW_PORT",
    "METACLAW_CHECKPOINT_DIR",
    "METACLAW_TRAINING_DEVICES",
    "METACLAW_INFERENCE_DEVICES",
    "METACLAW_INFERENCE_BACKEND",
)


def settings(*overrides: str) -> ServerSettings:
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("serve", overrides=["app=training_server", "model=tiny", *overrides])
    return ServerSettings.from_config(cfg)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_the_seeds() -> None:
    s = settings()
    assert (s.host, s.port, s.api_key) == ("127.0.0.1", 8000, None)
    assert s.checkpoint_dir == Path("/mnt/data/metaclaw_checkpoints")
    assert (s.training_devices, s.inference_devices, s.inference_backend) == ([], [], "hf")


def test_environment_wins_over_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("METACLAW_API_KEY", "k")
    monkeypatch.setenv("METACLAW_PORT", "9123")
    monkeypatch.setenv("METACLAW_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("METACLAW_TRAINING_DEVICES", "0,1")
    monkeypatch.setenv("METACLAW_INFERENCE_DEVICES", "2, 3")
    monkeypatch.setenv("METACLAW_INFERENCE_BACKEND", "VLLM")
    s = settings("serve.port=7000", "serve.api_key=from-config")
    assert (s.port, s.api_key, s.checkpoint_dir) == (9123, "k", tmp_path)
    assert (s.training_devices, s.inference_devices, s.inference_backend) == ([0, 1], [2, 3], "vllm")


def test_explicit_app_override_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METACLAW_PORT", "9123")
    assert settings("app.port=7001").port == 7001
    assert settings("serve.port=7002").port == 9123


def test_config_groups_still_apply() -> None:
    s = settings("backend=vllm", "devices=split_gpu", "serve.api_key=cfg-key")
    assert (s.inference_backend, s.training_devices, s.inference_devices, s.api_key) == ("vllm", [0], [1], "cfg-key")


@pytest.mark.parametrize(("value", "field"), [("tpu", "inference_backend"), ("eighty", "port")])
def test_bad_values_name_the_field(monkeypatch: pytest.MonkeyPatch, value: str, field: str) -> None:
    monkeypatch.setenv("METACLAW_INFERENCE_BACKEND" if field == "inference_backend" else "METACLAW_PORT", value)
    with pytest.raises(ConfigError, match=field):
        settings()


def test_parse_devices() -> None:
    assert parse_devices("0,1", None, "x") == [0, 1]
    assert parse_devices(None, [3], "x") == [3]
    assert parse_devices("cpu", [3], "x") == []
    with pytest.raises(ConfigError, match="x"):
        parse_devices("a,b", None, "x")
