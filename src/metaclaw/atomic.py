"""Crash-safe writes: fill a temp dir (or file) beside the target, fsync it, rename it into place, then fsync the
parent directory so the rename itself survives a power loss (POSIX makes a rename durable only then)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory: makes the entries renamed into (or out of) it durable. A no-op where directories cannot
    be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the rename has happened either way
        pass
    finally:
        os.close(fd)


def write_file_atomically(target: Path, data: bytes | str, mode: int = 0o600) -> Path:
    """Write `data` to a temp file beside `target` (created with `mode`), fsync it, rename it over `target`, fsync
    the parent: readers see the old file or the whole new one, never a torn one, and a crash keeps one of them."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def write_dir_atomically(target: Path, fill: Callable[[Path], None], replace: bool = True,
                         exclusive: bool = False) -> Path:  # fmt: skip
    """Call `fill(tmp_dir)`, fsync what it wrote, then rename `tmp_dir` to `target`.

    Readers see either the old directory or the complete new one, never a half-written one. With
    `replace=False` an existing `target` wins (a concurrent writer built the same thing) and the copy is dropped.
    With `exclusive=True` a non-empty `target` that exists at the rename (created meanwhile by someone else) is
    left alone and `FileExistsError` raised: nothing this call did not create is ever removed.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fill(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            elif f.is_dir():
                fsync_dir(f)
        fsync_dir(tmp)
        if exclusive:
            try:
                os.rename(tmp, target)  # fails on a non-empty directory or a file: never replaced
            except OSError as e:
                raise FileExistsError(f"{target} appeared while it was being written; left as it is") from e
        elif target.exists() and replace:
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))  # ours alone
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        elif target.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                os.rename(tmp, target)
            except OSError:  # another process renamed its copy first
                if replace or not target.exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)  # the rename is durable only once the parent directory is
    return target
