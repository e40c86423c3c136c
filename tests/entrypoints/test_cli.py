"""The `metaclaw` command: help, pass-through to the control commands, `train` from outside any clone, the policy
server started through the package, the sweep objective; the wheel check (slow)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import metaclaw
from metaclaw.cli import OBJECTIVE, config_groups, main, objective
from metaclaw.config import CONFIG_DIR
from metaclaw.loop.policy_server import PolicyServerProcess, server_command

REPO = Path(__file__).resolve().parents[2]
SRC = str(REPO / "src")


def run_metaclaw(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "metaclaw", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_help_lists_the_subcommands_and_every_config_group(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in ("train", "serve", "status", "pause", "resume", "train-now", "rollback", "skills", "forget",
                    "dashboard", "export", "import"):  # fmt: skip
        assert f"\n  {command} " in text, command
    groups = config_groups()
    assert {"model", "logger", "method", "rollout", "backend"} <= set(groups)
    for group, options in groups.items():
        assert f"  {group:<12} {', '.join(options)}" in text
    assert "tiny" in groups["model"] and "csv_wandb" in groups["logger"]


def test_unknown_command_says_so_and_control_commands_pass_through(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["rollback", "--help"])  # the control CLI's own parser answers
    assert exit_.value.code == 0
    assert "step" in capsys.readouterr().out


def test_version_comes_from_the_package_metadata():
    assert metaclaw.__version__ == importlib.metadata.version("metaclaw")


def test_config_tree_ships_inside_the_package():
    assert Path(metaclaw.__file__).parent / "conf" == CONFIG_DIR
    assert (CONFIG_DIR / "train.yaml").is_file() and (CONFIG_DIR / "serve.yaml").is_file()
    assert not (REPO / "conf").exists()  # one tree: the package's


def test_train_runs_from_a_directory_outside_the_clone(tmp_path):
    """`python -m metaclaw train` composes `pkg://metaclaw.conf` wherever it is started; Hydra overrides pass."""
    run = tmp_path / "run"
    out = run_metaclaw("train", "model=tiny", "rollout=store", "trainer.max_steps=2", f"hydra.run.dir={run}",
                       cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "adapters" / "step-000002" / "adapter_model.safetensors").exists()
    assert (run / "train.log").exists()  # the job's name is `train`, however it is started
    assert "max_steps: 2" in (run / ".hydra" / "config.yaml").read_text()
    assert not (tmp_path / "outputs").exists()


def test_train_help_is_hydras_and_lists_the_config_groups(tmp_path):
    out = run_metaclaw("train", "--help", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "== Configuration groups ==" in out.stdout and "model: " in out.stdout


def test_the_live_loop_starts_its_server_through_the_package_not_a_file_beside_it(tmp_path):
    """Old main found `serve.py` at `parents[2]` of the package: absent from a wheel."""
    assert server_command() == [sys.executable, "-m", "metaclaw", "serve"]
    proc = PolicyServerProcess({"serve": {"port": 1}}, run_dir=tmp_path)
    assert proc.args[:4] == [sys.executable, "-m", "metaclaw", "serve"] and "serve.py" not in " ".join(proc.args)
    custom = PolicyServerProcess({"serve": {"port": 1}}, run_dir=tmp_path, script="/opt/my_serve.py")
    assert custom.args[:2] == [sys.executable, "/opt/my_serve.py"]  # serving.process.script still wins


def test_the_sweep_objective_is_held_out_compliance():
    assert objective({OBJECTIVE: 0.8, "loss/total": 0.1}) == 0.8
    assert objective({"loss/total": 0.1}) is None  # no evaluation: no objective, never the loss in its place


@pytest.mark.slow
def test_wheel_installs_in_clean_environments_and_trains_and_serves_outside_the_clone(tmp_path):
    """scripts/check_wheel.sh: the wheel into a clean venv, pipx and uv tool environments with the registry's
    dependencies, `metaclaw models install`, `metaclaw train` on the embedded default, `metaclaw serve`."""
    if shutil.which("bash") is None:
        pytest.skip("bash is needed")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    out = subprocess.run(["bash", str(REPO / "scripts" / "check_wheel.sh"), str(tmp_path / "w")], env=env,
                         capture_output=True, text=True, timeout=3600)  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    for check in ("pip install (clean venv, registry resolution)", "metaclaw models install",
                  "train (embedded default, 2 steps)", "serve", "pipx install + models install",
                  "uv tool install + models install"):  # fmt: skip
        assert f'"check": "{check}", "ok": true' in out.stdout, check


def test_the_optuna_sweep_example_composes_and_maximises_the_objective():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="the sweep extra (metaclaw[sweep])")
    from hydra import compose, initialize_config_dir

    from metaclaw.config import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["+experiment=sweep_optuna"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize"
    assert set(sweeper.params) == {"optimizer.lr", "policy.rank"}  # both are real fields of train.yaml
    assert "lr" in cfg.optimizer and "rank" in cfg.policy


@pytest.mark.parametrize("argv", [["import", "/nonexistent", "--run-dir", "/nonexistent"],
                                  ["export", "latest", "--run-dir", "/nonexistent", "--format", "peft", "--out", "/x"],
                                  ["forget", "--help"]])  # fmt: skip
def test_import_export_and_forget_write_private_files(argv, capsys):
    """Issue 43 (finding 8): what `import`, `export` and `forget` create is 0600 / 0700 (umask 077)."""
    before = os.umask(0o022)
    try:
        with contextlib.suppress(SystemExit):  # `--help`
            main(argv)
        assert os.umask(0o022) == 0o077
    finally:
        os.umask(before)
