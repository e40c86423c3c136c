"""Where saved adapters and checkpoints live: one namespace per session, names checked, disk quotas enforced.

Layout: `<checkpoint_dir>/adapters/<session_id>/<name>/` and `<checkpoint_dir>/checkpoints/<session_id>/<name>/`;
`checkpoints/shared/<name>/` holds checkpoints an operator shares between sessions. Error messages name paths
relative to the checkpoint directory, never absolute ones.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TypeVar

from metaclaw.training_server.errors import ApiError, bad_request

T = TypeVar("T")

MAX_NAME_BYTES = 200  # leaves room for the atomic writer's `.<name>-XXXXXXXX` temp dir under NAME_MAX (255)
SHARED = "shared"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


def check_name(name: str, field: str) -> str:
    """A single path component of letters, digits, `.`, `_`, `-` (not starting with `.`), ≤ 200 bytes."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise bad_request(f"{field} is {size} bytes long; at most {MAX_NAME_BYTES} are allowed", field)
    if not _NAME.match(name):
        raise bad_request(
            f"{field} {name[:40]!r} must be one path component of letters, digits, '.', '_' or '-' "
            "(not starting with '.')",
            field,
        )
    return name


def dir_size(path: Path) -> int:
    """Bytes of the regular files under `path` (0 when it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


class Area:
    """One saved-artifact area (`adapters/` or `checkpoints/`) with its quota.

    Args:
        root: the area's directory.
        quota_bytes: total size the area may reach.
        label: `adapters` or `checkpoints` (for messages).
    """

    def __init__(self, root: Path, quota_bytes: int, label: str) -> None:
        self.root, self.quota, self.label = root, quota_bytes, label

    def relative(self, path: Path) -> str:
        """`adapters/<ns>/<name>`: how messages name a path."""
        try:
            return f"{self.label}/{path.relative_to(self.root.resolve()).as_posix()}"
        except ValueError:
            return self.label

    def target(self, namespace: str, name: str, field: str) -> Path:
        return self.root.resolve() / namespace / check_name(name, field)

    def write(self, target: Path, expected_bytes: int, write: Callable[[Path], T], field: str) -> T:
        """Refuse with 507 before writing when the area would exceed its quota; 507 on a full disk too.

        A refused or failed write leaves nothing behind (the writers build a temp dir and rename it).
        """
        used = dir_size(self.root) - dir_size(target)
        if used + expected_bytes > self.quota:
            raise ApiError(
                507,
                f"saving {self.relative(target)} needs about {expected_bytes} bytes; {self.label}/ holds {used} of "
                f"its {self.quota}-byte quota (app.limits.{self.label[:-1]}_quota_mb). Delete old saves or raise "
                "the quota; nothing was written",
                field,
            )
        try:
            return write(target)
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                message = f"the disk is full while saving {self.relative(target)}; nothing was kept"
                raise ApiError(507, message, field) from None
            raise

    def resolve_load(self, path: str, own: str, live: Collection[str], field: str) -> Path:
        """A checkpoint a session may load: its own, `shared/`, or one whose session no longer exists.

        `path` is a bare name (the caller's namespace), `<namespace>/<name>`, or the absolute path `save`
        returned. A checkpoint of another live session is refused (403).
        """
        if not path or "\x00" in path:
            raise bad_request(f"{field} must be a checkpoint name or path", field)
        root = self.root.resolve()
        candidate = Path(path)
        if candidate.is_absolute():
            try:
                parts = candidate.resolve().relative_to(root).parts
            except ValueError:
                raise bad_request(f"{field} must name a checkpoint inside {self.label}/", field) from None
        else:
            parts = candidate.parts
        if len(parts) == 1:
            parts = (own, *parts)
        if len(parts) != 2:
            raise bad_request(f"{field} must be <name> or <session_id>/<name> inside {self.label}/", field)
        namespace, name = parts
        for part in parts:
            check_name(part, field)
        if namespace != own and namespace != SHARED and namespace in live:
            raise ApiError(
                403,
                f"{field} {namespace}/{name} belongs to another live session; a session's checkpoints are its own "
                f"while it lives (share them under {self.label}/{SHARED}/)",
                field,
            )
        directory = (root / namespace / name).resolve()
        if root not in directory.parents:
            raise bad_request(f"{field} must name a checkpoint inside {self.label}/", field)
        return directory
