"""In-process pieces of the process story: the server's config file, stop requests, parent-death binding."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from metaclaw.datamodules.rollout import StreamingSampleDataset
from metaclaw.loop.policy_server import PolicyServerProcess
from metaclaw.stopping import RunAbandoned, StopController
from metaclaw.store import SampleStore
from metaclaw.wire.security import open_server_warning


def test_server_config_file_holds_the_resolved_nodes_as_data_and_no_key(tmp_path):
    nodes = {
        "model": {"name": "m", "path": "/models/${oc.env:HOME}"},
        "backend": {"name": "hf"},
        "devices": {"train": [], "infer": []},
        "serve": {"port": 0, "api_key": "secret", "max_concurrency": 3},
    }
    server = PolicyServerProcess(nodes, run_dir=tmp_path, api_key="secret")
    server._write_config()
    text = server.config_path.read_text()
    assert "secret" not in text  # the key travels in the child's environment only
    assert oct(server.config_path.stat().st_mode & 0o777) == "0o600"
    cfg = OmegaConf.create(yaml.safe_load(text))
    assert cfg.model.path == "/models/${oc.env:HOME}"  # a `${` in a value stays data, never an interpolation
    assert cfg.serve.port == server.port > 0 and cfg.serve.max_concurrency == 3
    assert cfg.serve.adapter_root == str((tmp_path / "adapters").resolve())
    assert server.args[-4:] == ["--config-dir", str((tmp_path / "server").resolve()), "--config-name", "serve_config"]


def test_a_stop_request_ends_a_stream_that_waits_forever(tmp_path):
    path = tmp_path / "s.sqlite"
    SampleStore(path).close()
    stop = StopController()
    ds = StreamingSampleDataset(path, lambda: 0, pad_id=0, batch_size=2, max_tokens=None, max_sample_tokens=None,
                                wait_timeout_s=None, should_stop=stop.should_stop)  # fmt: skip
    threading.Timer(0.5, stop.request, ("test",)).start()
    t0 = time.monotonic()
    assert list(ds) == []
    assert time.monotonic() - t0 < 5.0


def test_signals_request_a_stop_and_abandon_raises_only_inside_fit():
    stop = StopController("abandon")
    with stop.signals_installed():
        os.kill(os.getpid(), signal.SIGTERM)  # outside fit: a request, nothing raised
        time.sleep(0.05)
        assert stop.state() == {"stopping": True, "reason": "received SIGTERM", "error": None, "on_signal": "abandon"}
        with pytest.raises(RunAbandoned), stop.fitting():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    failed = StopController()
    failed.request("the policy server died", error=True)
    assert failed.error == "the policy server died" and failed.stopping
    with pytest.raises(ValueError, match="stop.on_signal"):
        StopController("later")


def test_a_bound_child_dies_with_its_parent_even_by_sigkill(tmp_path):
    """parent → child (bound with metaclaw.lifecycle); SIGKILL the parent: the child goes too."""
    pidfile = tmp_path / "child.pid"
    child = (f"import time; from metaclaw.lifecycle import die_with_parent; die_with_parent(); "
             f"open({str(pidfile)!r}, 'w').write(str(__import__('os').getpid())); time.sleep(600)")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(600)"])  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        pid = int(pidfile.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_open_server_warning_says_who_can_reach_it():
    assert "every user and process on this machine" in open_server_warning("The policy server", "127.0.0.1", 8000)
    assert "anyone who can reach 0.0.0.0 on the network" in open_server_warning("The policy server", "0.0.0.0", 1)
