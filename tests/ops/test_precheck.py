"""Five common mistakes, each one line naming the fix, before Hydra runs and before any model loads."""

from __future__ import annotations

import socket
import time

import pytest

from metaclaw.cli import main


def one_line(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    message = str(exc.value.code)
    assert "\n" not in message and "Traceback" not in message, message
    return message


def test_a_mistyped_key_suggests_the_close_match_not_a_plus():
    message = one_line(["train", "data.batch_sise=4"])
    assert message.startswith("metaclaw: unknown setting 'data.batch_sise': did you mean data.batch_size")
    assert "To append to your config use +" not in message  # Hydra's advice, wrong for a typo


def test_a_wrong_type_names_the_field_and_what_it_takes():
    assert one_line(["train", "data.batch_size=four"]) == (
        "metaclaw: data.batch_size='four': input should be a valid integer, unable to parse string as an integer"
    )
    assert one_line(["train", "log.format=jsno"]) == "metaclaw: log.format='jsno': input should be 'text' or 'json'"
    assert one_line(["serve", "serve.port=70000"]).startswith("metaclaw: serve.port=70000: input should be less")


def test_a_busy_port_is_found_before_any_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        message = one_line(["train", "model=tiny", "rollout=proxy", f"rollout.proxy.port={port}"])
        serve = one_line(["serve", "model=tiny", f"serve.port={port}"])
    assert time.monotonic() - t0 < 10  # composed and checked, nothing loaded
    assert f"port {port} on 127.0.0.1 (the rollout proxy) is in use" in message
    assert "rollout.proxy.port=N" in message
    assert f"port {port} on 127.0.0.1 (the policy server) is in use" in serve and "serve.port=N" in serve


def test_a_missing_run_directory(tmp_path):
    message = one_line(["status", "--run-dir", str(tmp_path / "nope")])
    assert message.startswith(f"metaclaw: no run directory at {tmp_path / 'nope'}: give the directory")


def test_an_unknown_model_names_the_options():
    assert one_line(["train", "model=qwen3_8bb"]) == (
        "metaclaw: unknown model 'qwen3_8bb': did you mean model=qwen3_8b? (options: qwen3_4b, qwen3_8b, smollm2_135m, "
        "tiny)"
    )


def test_valid_overrides_and_hydra_options_pass(monkeypatch):
    from metaclaw.cli import config_groups
    from metaclaw.ops.precheck import check_command_line

    check_command_line("train", ["model=tiny", "data.batch_size=8", "+foo.bar=1", "++baz=2", "hydra.run.dir=/tmp/x",
                                 "rollout.proxy.port=0", "trainer.max_time=null"], config_groups())  # fmt: skip
    check_command_line("train", ["--cfg", "job", "data.batch_sise=1"], config_groups())  # Hydra's own command line


@pytest.mark.slow  # ~20 s: the train command imports torch before its device plan
def test_a_device_plan_mistake_is_one_line_without_a_traceback(tmp_path):
    import subprocess
    import sys

    from tests.procs import REPO

    env = {"PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "metaclaw", "train", "model=tiny", "devices.train=[0,0]", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert "Config: devices.train lists a GPU twice: [0, 0]" in out.stderr + out.stdout
