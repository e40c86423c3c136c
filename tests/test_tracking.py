"""Tracking (`metaclaw.tracking`): several loggers at once, hyperparameters without keys, adapters as W&B artifacts
(offline) with the served one aliased; the optional extras say what to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import yaml
from omegaconf import OmegaConf

from metaclaw.evaluation.report import write_report
from metaclaw.scheduler import calendar as calendar_mod
from metaclaw.store import SampleStore
from metaclaw.tracking import REDACTED, MissingExtra, check_loggers, logger_nodes, public_config

REPO = Path(__file__).resolve().parents[1]
SECRET = "sk-test-TRACKING-4f9a2c"


def test_public_config_redacts_every_credential_field_and_keeps_the_rest():
    cfg = OmegaConf.create({"serve": {"api_key": SECRET, "port": 0}, "judge": {"api_key": None, "model": "m"},
                            "x": {"hf_token": "t0k3n", "secret": "s", "password": "p", "keep_last": 20},
                            "optimizer": {"lr": 3e-4}, "lst": [{"proxy_key": "k"}]})  # fmt: skip
    out = public_config(cfg)
    assert out["serve"] == {"api_key": REDACTED, "port": 0}
    assert out["judge"] == {"api_key": None, "model": "m"}  # nothing to hide
    assert out["x"] == {"hf_token": REDACTED, "secret": REDACTED, "password": REDACTED, "keep_last": 20}
    assert out["optimizer"]["lr"] == 3e-4 and out["lst"] == [{"proxy_key": REDACTED}]


def test_several_loggers_by_name_and_a_missing_wandb_is_named(monkeypatch):
    cfg = OmegaConf.create({"logger": {"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger"},
                                       "wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger"}}})  # fmt: skip
    assert list(logger_nodes(cfg)) == ["csv", "wandb"]
    assert logger_nodes(OmegaConf.create({"logger": {"_target_": None}})) == {}
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(MissingExtra, match=r"metaclaw\[wandb\]"):
        check_loggers(cfg)


def test_without_matplotlib_the_report_says_how_to_get_the_plot(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    results = [{"step": 0, "adapter": "base", "compliance": 0.25, "n": 4},
               {"step": 2, "adapter": "step-000002", "compliance": 0.5, "n": 4}]  # fmt: skip
    summary = write_report(tmp_path, results, SampleStore(tmp_path / "s.sqlite"), 2, 60.0)
    assert summary["plot"] is None and "pip install 'metaclaw[plots]'" in summary["text"]
    assert summary["final_compliance"] == 0.5 and not (tmp_path / "compliance.png").exists()


def test_without_icalendar_a_configured_calendar_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(calendar_mod, "icalendar", None)
    with pytest.raises(calendar_mod.CalendarError, match=r"metaclaw\[calendar\]"):
        calendar_mod.CalendarWindows(str(tmp_path / "meetings.ics"), ZoneInfo("UTC"))


def test_csv_and_wandb_offline_get_the_hyperparameters_without_the_key_and_wandb_the_adapters(tmp_path):
    """`metaclaw train logger=csv_wandb` (W&B offline): both loggers get the resolved config with the key given on
    the command line redacted; each published adapter is a version of the `adapter` artifact, the served one
    aliased `served`."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    out = subprocess.run([sys.executable, "-m", "metaclaw", "train", "model=tiny", "rollout=store", "logger=csv_wandb",
                          "trainer.max_steps=2", f"serve.api_key={SECRET}", f"hydra.run.dir={run}"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    hparams = yaml.safe_load((run / "csv" / "hparams.yaml").read_text())
    assert hparams["optimizer"]["lr"] == 3.0e-4 and hparams["model"]["name"]
    assert hparams["serve"]["api_key"] == REDACTED
    [wandb_file] = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    records = wandb_file.read_bytes()  # W&B's record log (protobuf): the strings are stored as they are
    assert b"lora-adapter" in records and b"step-000001" in records and b"step-000002" in records
    assert b"served" in records and b"latest" in records
    assert REDACTED.encode() in records  # the config record: the key's field is there, its value is not
    assert SECRET.encode() not in records
    assert SECRET not in (run / "csv" / "hparams.yaml").read_text()


class _Run:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, list[str]]] = []
        self.experiment = self

    def log_artifact(self, artifact, aliases) -> None:
        self.logged.append((dict(artifact.metadata), list(aliases)))


def test_only_served_adapters_become_artifact_versions_unless_every_n(tmp_path, monkeypatch):
    """Five published adapters, the server serving step 4: one version (step 4); every_n_steps=2 adds step 2."""
    from types import SimpleNamespace

    from metaclaw import tracking

    monkeypatch.setattr(tracking, "is_wandb", lambda lg: isinstance(lg, _Run))
    for step in range(1, 6):
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"x" * step)
    (tmp_path / "latest.json").write_text(json.dumps({"path": str(tmp_path / "step-000004")}))
    for every, expected in ((None, [4]), (2, [2, 4])):
        run = _Run()
        trainer = SimpleNamespace(loggers=[run], is_global_zero=True)
        callback = tracking.AdapterArtifacts(tmp_path, every_n_steps=every)
        callback.sync(trainer)
        callback.sync(trainer)  # nothing new: nothing logged twice
        assert [m["step"] for m, _ in run.logged] == expected
        assert [a for m, a in run.logged if m["step"] == 4] == [["step-000004", "served"]]
