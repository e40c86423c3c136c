"""Helpers for the process tests: the process tree from /proc, waiting for processes to go, a train.py launcher."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx

from metaclaw.runfiles.layout import SERVER_ROLES
from tests.e2e.conftest import ENV, REPO


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone: it holds no memory, port or GPU)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[1], []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and alive(child):
                found.add(child)
                todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def wait_gone(pids: Iterable[int], timeout: float = 20.0) -> set[int]:
    """Wait until none of `pids` runs; returns those still running at the deadline."""
    pids = set(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = {p for p in pids if alive(p)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 240.0, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise AssertionError(f"train.py exited ({proc.returncode}) before {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def launch_train(run_dir: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    """`train.py model=tiny ...` in its own session; stdout+stderr to `<run_dir>.out`."""
    out = run_dir.with_suffix(".out")
    args = [sys.executable, "train.py", "model=tiny", "logger=none", f"hydra.run.dir={run_dir}", *overrides]
    with open(out, "wb") as f:
        proc = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def kill_tree(proc: subprocess.Popen) -> None:
    """Test cleanup: SIGKILL the launcher's group and every descendant left."""
    pids = descendants(proc.pid)
    for pid in [proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


SERVER = "-m metaclaw serve "  # how train.py starts its policy server (loop/policy_server.py)
# For runs whose subject is not live evaluation's own server (`devices.eval_server`; its tests:
# tests/evaluation/test_eval_server.py): one server process fewer on the 2-core CI machine.
ONE_SERVER = "devices.eval_server=false"


def server_pid(proc: subprocess.Popen, role: str = "policy") -> int | None:
    """The main process of a server below train.py: the child whose command line runs `-m metaclaw serve` from
    `role`'s folder (`policy`: the agent's; `eval`: live evaluation's own, `devices.eval_server`)."""
    folder = f"{os.sep}{SERVER_ROLES[role]} "  # `--config-dir <run dir>/<folder> --config-name ...`
    for pid in descendants(proc.pid):
        line = cmdline(pid)
        if SERVER in line and folder in line and SERVER not in cmdline(_stat(pid)[1] if _stat(pid) else 0):
            return pid
    return None


def models(url: str, key: str | None) -> dict | None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None
