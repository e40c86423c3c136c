"""The packaging for operation (docs/operate.md): Dockerfile, compose.yaml and the systemd user unit are valid, run
one command, and that command starts a service answering `/health` and `/metrics` (the image is not built here)."""

from __future__ import annotations

import configparser
import json
import shlex
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import REPO, free_port, serving

UNIT = REPO / "deploy" / "metaclaw.service"
KEY = "k-packaging-test"


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def unit_args() -> list[str]:
    """The unit's `metaclaw` arguments, without the run directory (a path of the host)."""
    words = shlex.split(unit()["Service"]["ExecStart"])
    assert words[0].endswith("/bin/metaclaw")
    return [w for w in words[1:] if not w.startswith("hydra.run.dir=")]


def dockerfile_cmd() -> list[str]:
    lines = (REPO / "Dockerfile").read_text().splitlines()
    [cmd] = [line for line in lines if line.startswith("CMD ")]
    return json.loads(cmd.removeprefix("CMD "))


def test_unit_restarts_on_failure_and_runs_the_live_loop():
    service = unit()["Service"]
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    assert unit_args()[:3] == ["train", "mode=auto", "rollout=proxy"]
    assert "API_KEY" not in service["Environment"] and service["EnvironmentFile"]  # the key: a 0600 file, not the unit
    assert unit()["Install"]["WantedBy"] == "default.target"
    if shutil.which("systemd-analyze"):  # the unit's syntax, as systemd reads it (the binary need not exist here)
        out = subprocess.run(["systemd-analyze", "--user", "verify", str(UNIT)], capture_output=True, text=True)
        assert "Unknown key" not in out.stderr and "Invalid section" not in out.stderr, out.stderr


def test_compose_builds_the_dockerfile_and_runs_the_units_command():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    svc = compose["services"]["metaclaw"]
    assert (REPO / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == REPO / "Dockerfile"
    assert svc["command"] == dockerfile_cmd()
    container_only = {"hydra.run.dir=/data/run", "rollout.proxy.host=0.0.0.0"}
    assert [a for a in svc["command"] if a not in container_only] == unit_args()
    assert any(v.endswith(":/data") for v in svc["volumes"]) and "/data" in (REPO / "Dockerfile").read_text()
    assert svc["environment"]["METACLAW_PROXY_API_KEY_FILE"] == "/run/secrets/proxy_key"
    assert svc["secrets"] == ["proxy_key"] and "proxy_key" in compose["secrets"]
    assert all(p.startswith("127.0.0.1:") for p in svc["ports"])  # the host's loopback unless the user opens it
    assert "/health" in " ".join(svc["healthcheck"]["test"]) and "HEALTHCHECK" in (REPO / "Dockerfile").read_text()


def test_entrypoint_refuses_to_start_without_a_key(tmp_path):
    out = subprocess.run(["sh", str(REPO / "deploy" / "entrypoint.sh"), "--version"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 64 and "METACLAW_PROXY_API_KEY" in out.stderr


@pytest.mark.slow
def test_the_units_command_answers_health_and_metrics(tmp_path):
    """`metaclaw <the unit's arguments>` with the tiny model and free ports: /health, then /metrics with the loop."""
    port = free_port()
    cmd = [sys.executable, "-m", "metaclaw", *unit_args(), f"hydra.run.dir={tmp_path / 'run'}", "model=tiny",
           f"rollout.proxy.port={port}"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serving(cmd, f"{url}/health", tmp_path / "service.log", env={"METACLAW_PROXY_API_KEY": KEY}, timeout_s=300):
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{url}/metrics").status_code == 401
        deadline, names = time.monotonic() + 60, set()
        while "metaclaw_samples" not in names and time.monotonic() < deadline:
            text = httpx.get(f"{url}/metrics", headers=headers).text
            names = {f.name for f in text_string_to_metric_families(text)}
            time.sleep(0.5)
        assert {"metaclaw_samples", "metaclaw_served_adapter_version", "metaclaw_requests",
                "metaclaw_train_steps"} <= names, names  # fmt: skip
        r = httpx.post(
            f"{url}/v1/chat/completions",
            headers=headers,
            timeout=120,
            json={"model": "metaclaw", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        text = httpx.get(f"{url}/metrics", headers=headers).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        captured = sum(s.value for s in families["metaclaw_samples"].samples)
        assert captured >= 1
        assert any(s.labels.get("kind") == "completion" and s.value > 0 for s in families["metaclaw_tokens"].samples)
    lines = (tmp_path / "service.log").read_text().splitlines()
    assert not [line for line in lines if "litlogger" in line or "litmodels" in line]  # no adverts
    assert not [line for line in lines if line.startswith("INFO: ")]  # Lightning's own handler: no second copy
    assert not [line for line in lines if "[INFO] - Scored " in line]  # the scorer's running counts: DEBUG
    assert [line for line in lines if "GPU available" in line] == [next(ln for ln in lines if "GPU available" in ln)]
