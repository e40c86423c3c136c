"""The scheduler's persistent state (`<run dir>/scheduler_state.json`): pause, train-now, the last window,
and a rolled-back adapter, so a restart picks up where the service left off."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from metaclaw.atomic import write_file_atomically

log = logging.getLogger(__name__)


@dataclass
class SchedulerState:
    """What survives a restart. Times are ISO 8601 strings in UTC."""

    paused: bool = False
    train_now_until: str | None = None
    window_open: bool = False
    window_reasons: list[str] = field(default_factory=list)
    window_since: str | None = None
    rollback_step: int | None = None  # the step whose adapter `rollback` re-pointed the server to
    rollback_agent: str | None = None  # whose adapter (None: the default agent's)
    updated_at: str | None = None

    @classmethod
    def load(cls, path: Path) -> SchedulerState:
        """The saved state; a missing file is a fresh start, an unreadable one is set aside loudly."""
        if not path.exists():
            return cls()
        try:
            raw: Any = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
            return cls(**known)
        except (OSError, ValueError, TypeError) as e:
            broken = path.with_suffix(".corrupt")
            os.replace(path, broken)
            log.error("Scheduler state %s unreadable (%s): moved to %s, starting unpaused", path, e, broken)
            return cls()

    def save(self, path: Path) -> None:
        """Write atomically (temp file, fsync, rename)."""
        write_file_atomically(path, json.dumps(asdict(self), indent=1))
