"""Sessions and turns: which conversation a request belongs to, its turn index, and the previous turn's sample.

The store is the source of truth (a session's turns are its samples); the tracker only caches it so the
request path never waits on SQLite. Finished sessions are recorded durably in a small `rollout_sessions`
table beside the samples, so the scorer (another thread or process) sees them too.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metaclaw.datamodules.store import SampleStore
from metaclaw.rollout.normalize import content_text

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollout_sessions (
    agent_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    done_at REAL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (agent_id, session_id)
);
"""


def derive_session_id(messages: list[dict[str, Any]], agent_id: str) -> str:
    """A stable id for a client that sends no `X-Session-Id`: hash of agent, system prompt and first user message."""
    system = next((content_text(m.get("content")) for m in messages if m.get("role") == "system"), "")
    first_user = next((content_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    digest = hashlib.sha256(json.dumps([agent_id, system, first_user]).encode()).hexdigest()[:16]
    return f"auto-{digest}"


def new_messages_since_last_assistant(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user/tool messages after the last assistant message: the previous turn's next state."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return [m for m in messages[i + 1 :] if m.get("role") in ("user", "tool")]
    return []


@dataclass
class SessionState:
    """What the proxy remembers about one session."""

    next_turn: int = 0
    last_sample_id: int | None = None
    last_turn: int = -1
    pending: set[int] = field(default_factory=set)  # turn indices in flight


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


class SessionTracker:
    """Allocates turn indices and remembers each session's last main-turn sample (cache over the store)."""

    def __init__(self, store: SampleStore, log: SessionLog) -> None:
        self.store, self.log = store, log
        self._sessions: dict[tuple[str, str], SessionState] = {}
        self._lock = threading.Lock()

    def state(self, agent_id: str, session_id: str) -> SessionState:
        """The cached state, loaded from the store on first sight (e.g. after a restart)."""
        key = (agent_id, session_id)
        with self._lock:
            st = self._sessions.get(key)
            if st is not None:
                return st
        samples = self.store.select(agent_id=agent_id, session_id=session_id)
        with self._lock:
            st = self._sessions.get(key)
            if st is None:
                st = SessionState()
                if samples:
                    last = max(samples, key=lambda s: s.turn_index)
                    st.next_turn, st.last_sample_id, st.last_turn = last.turn_index + 1, last.id, last.turn_index
                self._sessions[key] = st
            return st

    def known(self, agent_id: str, session_id: str) -> bool:
        if (agent_id, session_id) in self._sessions:
            return True
        return bool(self.store.select(agent_id=agent_id, session_id=session_id, limit=1))

    def begin_turn(self, state: SessionState) -> tuple[int, int | None]:
        """Allocate the next turn index; returns it and the previous turn's sample id (None if none yet)."""
        with self._lock:
            turn = state.next_turn
            state.next_turn += 1
            state.pending.add(turn)
            return turn, state.last_sample_id

    def end_turn(self, state: SessionState, turn: int, sample_id: int | None) -> None:
        with self._lock:
            state.pending.discard(turn)
            if sample_id is not None and turn > state.last_turn:
                state.last_sample_id, state.last_turn = sample_id, turn
