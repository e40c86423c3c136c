"""Child processes die with their parent, on every path (SIGKILL of the parent included).

Three layers, because each covers a case the others miss:
- `PR_SET_PDEATHSIG` (Linux `prctl`, through ctypes): the kernel signals the child when its parent exits.
- a watchdog thread that exits the process when its parent pid changes (re-parented to init/a subreaper):
  covers platforms without prctl and the window before prctl ran.
- process groups: `train.py` starts `serve.py` in its own session and signals the whole group on stop.

`serve.py` calls `bind_children()` before LitServe starts its workers: forked children (LitServe's API server,
the multiprocessing manager) run `die_with_parent` through `os.register_at_fork`; the spawned inference worker
calls `bind_to_spawning_parent()` first thing in `PolicyAPI.setup` (however the server was started: `metaclaw
serve`, `python -m metaclaw serve` or `serve.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PARENT_ENV = "METACLAW_PARENT_PID"  # set by a parent that wants its child bound to it


def set_pdeathsig(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux only; False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    return False


def _watch(parent: int, poll_s: float, sig: int) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent:
            log.error("parent process %d is gone: exiting", parent)
            os.kill(os.getpid(), sig)
            time.sleep(5.0)
            os._exit(1)


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM, poll_s: float = 1.0) -> None:
    """Bind this process's life to `parent` (default: the current parent pid): prctl + watchdog thread."""
    parent = os.getppid() if parent is None else parent
    set_pdeathsig(sig)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
    threading.Thread(target=_watch, args=(parent, poll_s, sig), name="parent-watchdog", daemon=True).start()


def _bind_forked_child() -> None:
    die_with_parent(sig=signal.SIGKILL)


def bind_children() -> None:
    """Every child this process forks from now on dies (SIGKILL) when this process dies."""
    os.register_at_fork(after_in_child=_bind_forked_child)


def bind_to_spawning_parent() -> None:
    """In a multiprocessing `spawn` child: die (SIGKILL) with the process that spawned it."""
    die_with_parent(sig=signal.SIGKILL)


def bind_to_launcher() -> None:
    """When started by a metaclaw parent that set `METACLAW_PARENT_PID`: die (SIGTERM) when it dies."""
    value = os.environ.pop(PARENT_ENV, None)
    if value and value.isdigit():
        die_with_parent(int(value), sig=signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    """A port no one listens on now (the OS's choice); the caller binds it next."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
