"""The run's control key: generated when the service starts, kept in `<run dir>/control.key` (mode 0600), read by
`python -m metaclaw --run-dir DIR`. It never appears in a URL, an argument or a config dump (docs/security.md)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

CONTROL_KEY_FILE = "control.key"


def issue_control_key(run_dir: str | os.PathLike) -> str:
    """A fresh random key for this run's control routes, written to `<run_dir>/control.key` (0600, atomically)."""
    key = secrets.token_urlsafe(32)
    path = Path(run_dir) / CONTROL_KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{CONTROL_KEY_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older file of that name keeps its mode through O_TRUNC
        os.write(fd, key.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key


def read_control_key(run_dir: str | os.PathLike) -> str | None:
    """The run's control key (None when the run wrote none)."""
    try:
        return (Path(run_dir) / CONTROL_KEY_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None
