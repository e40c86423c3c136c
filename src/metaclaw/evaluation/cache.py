"""The base model's held-out replies, sampled once and reused across runs (`ComplianceEvaluator(cache=...)`).

The base model does not change between runs, so its evaluation need not either: its replies (text and base NLL
per token) are stored under a key that hashes everything they depend on: the model's files (content, see
`model_fingerprint`), the engine and dtype, the exact messages asked (system prompt, prompts chosen by the seed,
injected skills), the sampling settings, `max_tokens`, replies per prompt and whether quality was measured.
Any change gives a new key; the verifier's verdicts are recomputed from the stored texts on every use, so a
change of preference with the same prompts reuses the replies honestly (they do not depend on it).

Entries live in `<cache root>/eval/<key>.json` (`$METACLAW_CACHE` or `~/.cache/metaclaw`, `eval.cache.dir`
overrides), written atomically; the directory keeps at most `max_entries` entries, the least recently used
removed first. A run with errors is not stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what is stored or how it is asked changes
_CHUNK = 16 << 20  # big files: size, head and tail are hashed (a changed checkpoint changes all three)


def _hash_file(path: Path, h: Any) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        if size <= 2 * _CHUNK:
            h.update(f.read())
            return
        h.update(f.read(_CHUNK))
        f.seek(size - _CHUNK)
        h.update(f.read(_CHUNK))


def model_fingerprint(where: str | Path) -> str:
    """A content hash of a model directory (every file; files over 32 MiB by size, head and tail) or file;
    the path itself when it is not local (a hub id)."""
    h = hashlib.sha256()
    path = Path(where)
    if path.is_file():
        _hash_file(path, h)
    elif path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            _hash_file(f, h)
    else:
        h.update(str(where).encode())
    return h.hexdigest()


class BaselineCache:
    """Base model replies by key, on disk, bounded (least recently used entries removed first).

    Args:
        root: the directory of entries; None: `<$METACLAW_CACHE or ~/.cache/metaclaw>/eval`.
        max_entries: entries kept.
    """

    def __init__(self, root: str | Path | None = None, max_entries: int = 32) -> None:
        from metaclaw.modules.loading import cache_root

        if max_entries < 1:
            raise ValueError(f"eval.cache.max_entries must be >= 1, got {max_entries}")
        self.root = Path(root).expanduser() if root else cache_root() / "eval"
        self.max_entries = max_entries

    @staticmethod
    def key(parts: dict[str, Any]) -> str:
        """The entry's name: a hash of everything the replies depend on."""
        return hashlib.sha256(json.dumps({"format": FORMAT, **parts}, sort_keys=True).encode()).hexdigest()[:32]

    def get(self, key: str) -> list[dict[str, Any]] | None:
        path = self.root / f"{key}.json"
        try:
            replies = json.loads(path.read_text())["replies"]
            os.utime(path)  # recently used
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return replies if isinstance(replies, list) else None

    def put(self, key: str, replies: list[dict[str, Any]], parts: dict[str, Any]) -> None:
        """Store `replies` (atomically), then keep the newest `max_entries` entries."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"key_parts": parts, "created": time.time(), "replies": replies}))
            os.replace(tmp, self.root / f"{key}.json")
            entries = sorted(self.root.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
            for old in entries[self.max_entries :]:
                old.unlink(missing_ok=True)
        except OSError as e:  # a read-only home: the evaluation is still right, only not reused
            log.warning("Eval cache: cannot store the base model's replies in %s: %s", self.root, e)
