"""Start a server in its own process group, wait for its health route, always stop the group.

The one copy of this for the bench and the tests (`tests/procs.py` re-exports it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from metaclaw.lifecycle import free_port

REPO = Path(__file__).resolve().parents[2]
__all__ = ["REPO", "free_port", "healthy", "serving", "start", "stop_group", "wait_for_health", "wait_healthy"]
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}


def healthy(url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 2.0) -> bool:
    """True when `url` answers 200 now."""
    try:
        return httpx.get(url, headers=dict(headers or {}), timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_health(base_url: str, timeout_s: float = 120.0) -> bool:
    """Poll `<base_url>/health` until it answers 200 (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if healthy(f"{base_url}/health", timeout_s=1):
            return True
        time.sleep(0.2)
    return False


def start(cmd: Sequence[str], log: Path | None, env: Mapping[str, str] | None = None,
          cwd: Path = REPO) -> subprocess.Popen:  # fmt: skip
    """`cmd` in its own session (so `stop_group` reaches its children), offline, output to `log` (None: inherit)."""
    full_env = {**os.environ, **QUIET_ENV, **(env or {})}
    if log is None:
        return subprocess.Popen(list(cmd), cwd=cwd, env=full_env, start_new_session=True)
    with open(log, "wb") as out:
        return subprocess.Popen(list(cmd), cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def wait_healthy(proc: subprocess.Popen, url: str, log: Path | None = None, timeout_s: float = 180.0,
                 headers: Mapping[str, str] | None = None) -> None:  # fmt: skip
    """Poll `url` until it answers 200; raise with the log's tail if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not healthy(url, headers):
        tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r:.200} exited with {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args!r:.200} did not answer {url} in {timeout_s:.0f} s:\n{tail}")
        time.sleep(0.3)


def stop_group(proc: subprocess.Popen, timeout: float = 15) -> int | None:
    """SIGTERM the process group, SIGKILL it if it lingers; the return code."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.wait(timeout=timeout)
    except ProcessLookupError:
        return proc.poll()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


@contextmanager
def serving(
    cmd: Sequence[str],
    health_url: str,
    log: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 180,
    headers: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Run `cmd` from the repo root until the block ends; fail with the log's tail if it never gets healthy."""
    proc = start(cmd, log, env)
    try:
        wait_healthy(proc, health_url, log, timeout_s, headers)
        yield proc
    finally:
        stop_group(proc)
