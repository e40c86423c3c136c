"""Crash-safe directory writes: fill a temp dir beside the target, fsync its files, then rename it into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_dir_atomically(target: Path, fill: Callable[[Path], None], replace: bool = True) -> Path:
    """Call `fill(tmp_dir)`, fsync what it wrote, then rename `tmp_dir` to `target`.

    Readers see either the old directory or the complete new one, never a half-written one. With
    `replace=False` an existing `target` wins (a concurrent writer built the same thing) and the copy is dropped.
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
        if target.exists() and replace:
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
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
    return target
