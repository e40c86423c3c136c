"""`SessionLog`: the durable record of finished sessions, a small `rollout_sessions` table beside the samples.

The proxy marks a session done (`X-Session-Done` or the done endpoint); the scorer (another thread or process)
reads the finished ones. Same file as the `SampleStore`, its own connection (each writer thread holds one).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollout_sessions (
    agent_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    done_at REAL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (agent_id, session_id)
);
"""


class SessionLog:
    """Durable record of sessions marked done (`X-Session-Done` or the done endpoint)."""

    def __init__(self, path: str | Path) -> None:
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(_SCHEMA)

    def touch(self, agent_id: str, session_id: str, done: bool = False) -> None:
        now = time.time()
        with self._lock:
            self._conn.execute(
                "INSERT INTO rollout_sessions (agent_id, session_id, done_at, updated_at) VALUES (?,?,?,?) "
                "ON CONFLICT(agent_id, session_id) DO UPDATE SET updated_at=excluded.updated_at, "
                "done_at=COALESCE(rollout_sessions.done_at, excluded.done_at)",
                (agent_id, session_id, now if done else None, now),
            )

    def done_sessions(self) -> set[tuple[str, str]]:
        with self._lock:
            rows = self._conn.execute("SELECT agent_id, session_id FROM rollout_sessions WHERE done_at IS NOT NULL")
            return {(a, s) for a, s in rows.fetchall()}

    def close(self) -> None:
        with self._lock:
            self._conn.close()
