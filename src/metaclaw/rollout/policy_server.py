"""Start `serve.py` (the policy server) as a subprocess for the live loop and wait until it is healthy."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

import metaclaw
from metaclaw.rollout.server import free_port

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Child setup: own process group, and SIGTERM when the trainer dies (even by SIGKILL; Linux only)."""
    os.setsid()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def default_script() -> Path:
    """`serve.py` beside the package's source tree (the repository root in a checkout)."""
    return Path(metaclaw.__file__).resolve().parents[2] / "serve.py"


class PolicyServerProcess:
    """`with PolicyServerProcess(model="tiny", run_dir=...) as srv:` runs serve.py on `srv.url`.

    Args:
        model: the `model=` config option of serve.py (e.g. `tiny`, `smollm2_135m`).
        run_dir: the training run's directory: adapters are loaded from `<run_dir>/adapters`, logs and Hydra
            output go to `<run_dir>/server`.
        port: 0 picks a free port.
        script: path to serve.py; None: the checkout's.
        extra_args: more Hydra overrides for serve.py (e.g. `backend=vllm`).
        startup_timeout_s: how long to wait for `/health`.
    """

    def __init__(
        self,
        model: str,
        run_dir: str,
        port: int = 0,
        script: str | None = None,
        extra_args: list[str] | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.port = port or free_port()
        self.run_dir = Path(run_dir)
        self.script = Path(script) if script else default_script()
        self.args = [
            sys.executable,
            str(self.script),
            f"model={model}",
            f"serve.port={self.port}",
            f"serve.adapter_root={(self.run_dir / 'adapters').resolve()}",
            f"hydra.run.dir={(self.run_dir / 'server').resolve()}",
            *(extra_args or []),
        ]
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PolicyServerProcess:
        (self.run_dir / "server").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "adapters").mkdir(parents=True, exist_ok=True)
        logfile = open(self.run_dir / "server" / "server.log", "ab")  # noqa: SIM115 - lives as long as the child
        log.info("Starting policy server: %s (log: %s)", " ".join(self.args[1:]), logfile.name)
        self.proc = subprocess.Popen(self.args, stdout=logfile, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        logfile.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"policy server exited with {self.proc.returncode}; see {logfile.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    log.info("Policy server ready on %s", self.url)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"policy server not healthy after {self.startup_timeout_s}s; see {logfile.name}")

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
