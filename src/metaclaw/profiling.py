"""Where the CPU goes: per-phase wall and CPU seconds recorded by the components themselves
(`bench/perf/cycle_profile.py`).

Components wrap their work in `phase(name)`: the count, wall seconds and CPU seconds of every phase are summed
in-process. CPU is either the calling thread's own (`cpu="thread"`: exact for pure-Python work such as the
simulated user or the scorer) or the whole process's while the phase ran (`cpu="process"`: torch's intra-op
threads work for the caller, so the training step and generation are measured this way; a phase that overlaps
another in the same process shares its CPU with it). `tokens` counts what the phase produced or consumed.

Recording is always on (two clock reads per phase). With `METACLAW_PROFILE_DIR` set, `start_from_env(role)`
writes `<dir>/<role>-<pid>.json` every `METACLAW_PROFILE_EVERY_S` seconds (default 5) and at exit: the phases,
the process's CPU (user + system) and wall seconds since it started, and the CPU of each named Python thread.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

_lock = threading.Lock()
_phases: dict[str, list[float]] = {}  # name -> [count, wall_s, cpu_s, tokens]
_local = threading.local()
_started = time.monotonic()
_thread_cpu: dict[int, tuple[str, float]] = {}  # thread ident -> (name, latest CPU seconds seen)
_writer: threading.Thread | None = None


def record(name: str, wall_s: float, cpu_s: float, tokens: float = 0.0, count: int = 1) -> None:
    """Add one occurrence (or `count`) of phase `name`."""
    with _lock:
        row = _phases.setdefault(name, [0.0, 0.0, 0.0, 0.0])
        row[0] += count
        row[1] += wall_s
        row[2] += cpu_s
        row[3] += tokens


@contextmanager
def phase(name: str, cpu: Literal["thread", "process"] = "process") -> Iterator[dict[str, float]]:
    """Time the block as phase `name`; set `out["tokens"]` inside it to count tokens."""
    clock = time.thread_time if cpu == "thread" else time.process_time
    out: dict[str, float] = {"tokens": 0.0}
    w0, c0 = time.perf_counter(), clock()
    try:
        yield out
    finally:
        record(name, time.perf_counter() - w0, clock() - c0, out["tokens"])


def purpose() -> str:
    """Who the request this thread serves is for (`serve` unless `for_purpose` said otherwise)."""
    return getattr(_local, "purpose", "serve")


@contextmanager
def for_purpose(value: Any) -> Iterator[None]:
    """Tag this thread's work: the OpenAI `user` field of a request (`metaclaw-eval` for evaluation)."""
    previous = purpose()
    _local.purpose = value if isinstance(value, str) and re.fullmatch(r"[\w.:-]{1,64}", value) else "serve"
    try:
        yield
    finally:
        _local.purpose = previous


def snapshot() -> dict[str, Any]:
    """The phases, the process's CPU and wall seconds, and the CPU of each named Python thread (by name family)."""
    for t in threading.enumerate():
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
        except (OSError, TypeError, AttributeError):
            continue
        _thread_cpu[t.ident] = (t.name, cpu)  # type: ignore[index]
    threads: dict[str, float] = {}
    for name, cpu in list(_thread_cpu.values()):
        family = re.sub(r"[-_:]?\d+(?:_\d+)?$", "", name)  # simulated-user-0 -> simulated-user
        threads[family] = threads.get(family, 0.0) + cpu
    times = os.times()
    with _lock:
        phases = {k: {"n": int(v[0]), "wall_s": v[1], "cpu_s": v[2], "tokens": v[3]} for k, v in _phases.items()}
    return {
        "pid": os.getpid(),
        "process_cpu_s": times.user + times.system,
        "wall_s": time.monotonic() - _started,
        "phases": phases,
        "threads": threads,
    }


def start_from_env(role: str) -> Path | None:
    """With `METACLAW_PROFILE_DIR` set, write this process's snapshot there periodically and at exit."""
    global _writer
    root = os.environ.get("METACLAW_PROFILE_DIR")
    if not root or _writer is not None:
        return None
    path = Path(root) / f"{role}-{os.getpid()}.json"
    every = float(os.environ.get("METACLAW_PROFILE_EVERY_S", "5"))

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"role": role, **snapshot()}))
        os.replace(tmp, path)

    def loop() -> None:
        while True:
            time.sleep(every)
            write()

    _writer = threading.Thread(target=loop, name="profile-writer", daemon=True)
    _writer.start()
    atexit.register(write)
    return path
