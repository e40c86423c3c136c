"""Start the policy server (`python -m metaclaw serve`) for the live loop from the run's own config, and watch it.

One config, every process: the resolved `model`, `backend`, `devices` and `serve` nodes of the composed training
config are written to `<run_dir>/server/serve_config.yaml` and the server is started on that file
(`--config-dir <run_dir>/server --config-name serve_config`), so no field is forwarded by hand. The server's key
travels in its environment, never in the file. The child is bound to this process (`metaclaw.lifecycle`): it
dies when `metaclaw train` dies, even by SIGKILL. `watch()` restarts a server that died (bounded) or reports it.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from metaclaw.lifecycle import PARENT_ENV
from metaclaw.rollout.server import free_port
from metaclaw.runfiles.layout import SERVER_CONFIG_NAME, SERVER_LOG, RunLayout

log = logging.getLogger(__name__)

CONFIG_NAME = SERVER_CONFIG_NAME
SERVER_NODES = ("model", "backend", "devices", "serve", "log")  # every field of these reaches the server


def server_command(script: str | Path | None = None) -> list[str]:
    """The command that starts the server: the installed package's (`python -m metaclaw serve`), so it runs the
    same from a clone, a wheel or any working directory; `script` (serving.process.script): that file instead."""
    return [sys.executable, str(script)] if script else [sys.executable, "-m", "metaclaw", "serve"]


def _escape(value: Any) -> Any:
    """Resolved values are data: `${` in a string must not become an interpolation when the server reads the file."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape(v) for v in value]
    return value


def server_config(nodes: Mapping[str, Any], run_dir: Path, port: int, role: str = "policy") -> dict[str, Any]:
    """The server's primary config for this run: the given resolved nodes, this port, adapters of this run."""
    cfg = {k: _escape(dict(v) if isinstance(v, Mapping) else v) for k, v in nodes.items()}
    serve = dict(cfg.get("serve") or {})
    layout = RunLayout(run_dir)
    serve.update(port=port, api_key=None, adapter_root=str(layout.adapters_root.resolve()))
    cfg["serve"] = serve
    folder = str(layout.server_dir_of(role).resolve())
    backend = cfg.get("backend")
    if isinstance(backend, dict) and "log_file" in backend and not backend["log_file"]:  # vLLM's own output
        cfg["backend"] = {**backend, "log_file": f"{folder}/vllm.log"}
    return {
        "defaults": [{"app": "policy_server"}, "_self_"],
        **cfg,
        "run_dir": folder,
        "hydra": {"run": {"dir": folder}, "job": {"name": "serve", "chdir": False}},
    }


def server_env(api_key: str | None) -> dict[str, str]:
    """The environment serve.py starts with: this process's, less every other key it holds (the proxy owner's,
    the judge's, the evolver's, ...: a server process has no use for them), plus its own `METACLAW_API_KEY`."""
    env = {k: v for k, v in os.environ.items() if not _SECRET_ENV.match(k)}
    env[PARENT_ENV] = str(os.getpid())
    if api_key:
        env["METACLAW_API_KEY"] = api_key
    return env


_SECRET_ENV = re.compile(r"^METACLAW_\w*(?:KEY|TOKEN|SECRET)$")


@dataclass(frozen=True)
class ProcessWatch:
    """How the server process is waited for and kept alive (`PolicyServerProcess`'s arguments of these names)."""

    startup_timeout_s: float = 600.0  # how long to wait for `/health`
    max_restarts: int = 2  # how many times `watch()` restarts a server that died
    poll_s: float = 1.0  # how often `watch()` looks at the process


class PolicyServerProcess:
    """`with PolicyServerProcess(nodes, run_dir=...) as srv:` runs the policy server on `srv.url` (the run's settings).

    Args:
        nodes: resolved `model`, `backend`, `devices`, `serve` (plain dicts) of the training config.
        run_dir: the training run's directory: adapters are loaded from `<run_dir>/adapters`, the config, log
            and Hydra output go to `<run_dir>/server`.
        api_key: the key the server requires (given in its environment); None: an open server (warned about).
        script: a serve script to run instead of `python -m metaclaw serve` (None: the package's).
        extra_args: more Hydra overrides for the server.
        startup_timeout_s: how long to wait for `/health`.
        max_restarts: how many times `watch()` restarts a server that died.
        poll_s: how often `watch()` looks at the process.
        role: `policy` (the agent's server) or `eval` (live evaluation's own, `devices.eval_server`): its folder
            under the run dir (`metaclaw.runfiles.layout`); the port is always a free one for `eval`.
    """

    def __init__(
        self,
        nodes: Mapping[str, Any],
        run_dir: str | Path,
        api_key: str | None = None,
        script: str | None = None,
        extra_args: list[str] | None = None,
        startup_timeout_s: float = 600.0,
        max_restarts: int = 2,
        poll_s: float = 1.0,
        role: str = "policy",
    ) -> None:
        self.run_dir, self.role = Path(run_dir), role
        fixed = int((nodes.get("serve") or {}).get("port") or 0) if role == "policy" else 0
        self.port = fixed or free_port()
        self.config = server_config(nodes, self.run_dir, self.port, role)
        self.api_key = api_key
        self.folder = RunLayout(self.run_dir).server_dir_of(role)
        self.config_path = (self.folder / f"{CONFIG_NAME}.yaml").resolve()
        self.args = [*server_command(script), "--config-dir", str(self.config_path.parent), "--config-name",
                     CONFIG_NAME, *(extra_args or [])]  # fmt: skip
        self.keepalive = ProcessWatch(startup_timeout_s, max_restarts, poll_s)
        self.restarts = 0
        self.restarting = threading.Event()  # set while the watchdog brings a dead server back
        self.proc: subprocess.Popen | None = None
        self._deadline = 0.0
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def label(self) -> str:
        return "policy server" if self.role == "policy" else "evaluation's policy server"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def logfile(self) -> Path:
        return self.folder / SERVER_LOG

    def _write_config(self) -> None:
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        RunLayout(self.run_dir).adapters_root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# Written by train.py: this run's resolved model/backend/devices/serve settings.\n")
            yaml.safe_dump(self.config, f, sort_keys=False)

    def start(self) -> PolicyServerProcess:
        """Start the server and wait until `/health` answers (raises with the log's path when it does not)."""
        return self.launch().wait_ready()

    def launch(self) -> PolicyServerProcess:
        """Start the server's process and return at once (`wait_ready` waits for it): two servers load together."""
        self._write_config()
        env = server_env(self.api_key)
        with open(self.logfile, "ab") as logfile:
            log.info("Starting %s: %s (config %s, log %s)", self.label, " ".join(self.args), self.config_path,
                     self.logfile)  # fmt: skip
            self.proc = subprocess.Popen(
                self.args, stdout=logfile, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._deadline = time.monotonic() + self.keepalive.startup_timeout_s
        return self

    def wait_ready(self) -> PolicyServerProcess:
        """Wait until the launched server's `/health` answers (raises with the log's path when it does not)."""
        assert self.proc is not None, "launch() first"
        while time.monotonic() < self._deadline and not self._closing.is_set():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode}; see {self.logfile}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    log.info("%s ready on %s (pid %d)", self.label.capitalize(), self.url, self.proc.pid)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._kill_group(self.proc)
        raise TimeoutError(f"{self.label} not healthy after {self.keepalive.startup_timeout_s}s; see {self.logfile}")

    def unavailable(self) -> bool:
        """True while the watchdog owns the server: it is being restarted, or its process has exited."""
        return self.restarting.is_set() or (self.proc is not None and self.proc.poll() is not None)

    def watch(self, on_restart: Callable[[], None], on_death: Callable[[str], None]) -> None:
        """Watch the process in a thread: restart it up to `max_restarts` times, then call `on_death(reason)`."""
        self._watcher = threading.Thread(target=self._watch, args=(on_restart, on_death), name="server-watch",
                                         daemon=True)  # fmt: skip
        self._watcher.start()

    def _watch(self, on_restart: Callable[[], None], on_death: Callable[[str], None]) -> None:
        while not self._closing.wait(self.keepalive.poll_s):
            proc = self.proc
            if proc is None or proc.poll() is None:
                continue
            reason = f"the {self.label} (metaclaw serve, pid {proc.pid}) exited with code {proc.returncode}"
            self.restarting.set()
            while self.restarts < self.keepalive.max_restarts and not self._closing.is_set():
                self.restarts += 1
                log.error("%s; restarting it (%d/%d, log %s)", reason, self.restarts, self.keepalive.max_restarts,
                          self.logfile)  # fmt: skip
                self._kill_group(proc)
                try:
                    self.start()
                    on_restart()
                    self.restarting.clear()
                    break
                except Exception as exc:  # noqa: BLE001 - counted as a failed attempt
                    reason = f"the {self.label} could not be restarted: {exc}"
                    proc = self.proc or proc
            else:
                self.restarting.clear()
                if not self._closing.is_set():
                    on_death(f"{reason}; gave up after {self.restarts} restart(s) (serving.process.max_restarts); "
                             f"see {self.logfile}")  # fmt: skip
                return

    @staticmethod
    def _kill_group(proc: subprocess.Popen, timeout: float = 15.0) -> None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Stop the watcher, then SIGTERM the server's process group (SIGKILL if it lingers)."""
        self._closing.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self.keepalive.startup_timeout_s + 30)
        if self.proc is not None:
            self._kill_group(self.proc)

    def __enter__(self) -> PolicyServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
