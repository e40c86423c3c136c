"""Sessions and turns: which conversation a request belongs to, its turn index, and the previous turn's sample.

The store is the source of truth (a session's turns are its samples); the tracker only caches it so the
request path never waits on SQLite. Finished sessions are recorded durably in a small `rollout_sessions`
table beside the samples (`metaclaw.store.SessionLog`), so the scorer (another thread or process) sees them too.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from metaclaw.rollout.conversation import Query, Tail, canonical
from metaclaw.store import SampleStore, SessionLog
from metaclaw.wire import RequestError

BODY_EXTRAS = ("session_id", "turn_type", "session_done", "agent_id")  # read by the proxy, never forwarded upstream
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
MAX_ID_CHARS = 256
HEADER_SAFE = re.compile(r"^[\x20-\x7e\xa0-\xff]+$")  # printable Latin-1: what an HTTP header value can carry


@dataclass(frozen=True)
class SessionKeys:
    """What the client said about the session: `session_id` None means "derive it from the conversation"."""

    session_id: str | None
    source: str  # header | body | user | derived
    turn_type: str
    done: bool
    end_user: str | None = None  # OpenAI `user`: partitions derived sessions (never the session id itself)


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise RequestError(f"{name} must be true or false, got {value!r}")


def _id(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_ID_CHARS:
        raise RequestError(f"{name} must be a non-empty string of at most {MAX_ID_CHARS} characters")
    return value


def _session_id(value: Any, name: str) -> str:
    """A client's session id: also sent back in a response header (`x-metaclaw-session-id`), so it must be one."""
    value = _id(value, name)
    if not HEADER_SAFE.match(value):
        raise RequestError(f"{name} must be printable Latin-1 without control characters (CR, LF, ...): it is "
                           "sent back as a header")  # fmt: skip
    return value


def scoped_session_id(session_id: str, client_scope: str | None) -> str:
    """An explicit session id as stored: inside the caller's partition when it has one (an agent key's digest,
    `CLIENT_HEADER`), so another key that knows the id reaches a session of its own, never this one."""
    if not client_scope or session_id.startswith(f"{client_scope}:"):
        return session_id
    return f"{client_scope}:{session_id}"


def session_keys(body: dict[str, Any], headers: dict[str, str]) -> SessionKeys:
    """Session id, turn type and done flag; precedence: `X-*` headers > body fields > derived.

    Body fields are MetaClaw's own (`session_id`, `turn_type`, `session_done`). `user` is OpenAI's end-user field:
    one person's id, not one conversation's, so it only partitions derived sessions (a person's parallel
    conversations stay apart; two people's never meet).
    """
    end_user = _id(body["user"], "user") if body.get("user") is not None else None
    if headers.get("x-session-id"):
        session_id, source = _session_id(headers["x-session-id"], "X-Session-Id"), "header"
    elif body.get("session_id") is not None:
        session_id, source = _session_id(body["session_id"], "session_id"), "body"
    else:
        session_id, source = None, "derived" if end_user is None else "user"
    if headers.get("x-turn-type"):
        turn_type, field_name = headers["x-turn-type"], "X-Turn-Type"
    else:
        turn_type, field_name = body.get("turn_type") or "main", "turn_type"
    if not isinstance(turn_type, str) or turn_type.lower() not in ("main", "side"):
        raise RequestError(f"{field_name} must be main or side, got {turn_type!r}")
    if headers.get("x-session-done") is not None:
        done = _flag(headers["x-session-done"], "X-Session-Done")
    else:
        done = _flag(body.get("session_done", False), "session_done")
    return SessionKeys(session_id, source, turn_type.lower(), done, end_user)


AWAITING_MAX = 16  # turns one reaction may answer (an agent's own continuations of one reply), the oldest forgotten


def new_messages_since_last_assistant(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user/tool messages after the last assistant message: the previous turn's next state."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return [m for m in messages[i + 1 :] if m.get("role") in ("user", "tool")]
    return []


def reaction_messages(messages: list[dict[str, Any]], state: SessionState) -> list[dict[str, Any]]:
    """The previous turn's next state without the agent's transient tail, and `state` remembers this prompt's tail.

    Some agents (OpenClaw) append a message of their own runtime context to every request and leave it out of the
    history they send next time. Seen that way, as the previous prompt's last message missing before the reply it
    got, it is no reaction of the person's: the copy in this request (the same text, else the last new message) is
    not part of the next state, which the judge reads.
    """
    new = new_messages_since_last_assistant(messages)
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    prev, state.prompt_tail = state.prompt_tail, (canonical(messages[-1]) if messages else None)
    if prev is None or last < 1 or len(new) < 2 or canonical(messages[last - 1]) == prev:
        return new
    same = [i for i, m in enumerate(new) if canonical(m) == prev]
    drop = same[-1] if same else len(new) - 1
    return [m for i, m in enumerate(new) if i != drop]


@dataclass(eq=False)  # identity: a state sits in the table and in the tail index by reference
class SessionState:
    """What the proxy remembers about one session."""

    agent_id: str = ""
    session_id: str = ""
    next_turn: int = 0
    last_sample_id: int | None = None
    last_turn: int = -1
    pending: set[int] = field(default_factory=set)  # turn indices in flight
    tail: Tail | None = None  # derived sessions: what the next request of the conversation extends
    prompt_tail: bytes | None = None  # the last prompt's last message (`reaction_messages`)
    awaiting: list[int] = field(default_factory=list)  # turns the agent continued itself: the next reaction is theirs
    seen_at: float = field(default_factory=time.monotonic)


class SessionTracker:
    """Allocates turn indices, remembers each session's last main-turn sample, and finds derived sessions.

    The table is a cache over the store, bounded: at most `max_sessions` entries, least recently used evicted
    first, and an entry idle for `idle_s` is dropped. A session with a turn in flight is never evicted. An
    evicted session with an explicit id is reloaded from the store when it comes back; a derived one (no ids
    from the client) is forgotten, so its conversation continues as a new session.

    Args:
        store: the sample store (source of truth for explicit-id sessions).
        log: the durable record of finished sessions.
        max_sessions: the most sessions remembered at once.
        idle_s: a session not seen for this long is forgotten.
    """

    def __init__(self, store: SampleStore, log: SessionLog, max_sessions: int = 10000, idle_s: float = 3600.0) -> None:
        if max_sessions < 1 or idle_s <= 0:
            raise ValueError("sessions need max_sessions >= 1 and idle_s > 0")
        self.store, self.log, self.max_sessions, self.idle_s = store, log, max_sessions, idle_s
        self._sessions: OrderedDict[tuple[str, str], SessionState] = OrderedDict()
        self._tails: dict[tuple[str, str], list[SessionState]] = {}  # (kind, fingerprint) -> open sessions
        self._lock = threading.Lock()
        self.stats = {"evicted": 0, "expired": 0, "derived_new": 0, "derived_continued": 0, "derived_recovered": 0}

    def __len__(self) -> int:
        return len(self._sessions)

    # ---- the table ------------------------------------------------------------------------------------------
    def _touch(self, st: SessionState) -> None:
        """Mark `st` used now and enforce the bounds; call with the lock held."""
        st.seen_at = time.monotonic()
        key = (st.agent_id, st.session_id)
        self._sessions[key] = st
        self._sessions.move_to_end(key)
        horizon, excess = st.seen_at - self.idle_s, len(self._sessions) - self.max_sessions
        victims = []
        for old_key, old in self._sessions.items():  # least recently used first
            idle = old.seen_at < horizon
            if excess <= len(victims) and not idle:
                break  # the rest were used more recently
            if not old.pending and old is not st:
                victims.append((old_key, old, idle))
        for old_key, old, idle in victims:
            del self._sessions[old_key]
            self._unindex(old)
            self.stats["expired" if idle else "evicted"] += 1

    def _unindex(self, st: SessionState) -> None:
        if st.tail is None:
            return
        for key in st.tail.fingerprints():
            bucket = self._tails.get(key)
            if bucket and st in bucket:
                bucket.remove(st)
                if not bucket:
                    del self._tails[key]

    def state(self, agent_id: str, session_id: str) -> SessionState:
        """The cached state, loaded from the store on first sight (e.g. after a restart or an eviction)."""
        key = (agent_id, session_id)
        with self._lock:
            st = self._sessions.get(key)
            if st is not None:
                self._touch(st)
                return st
        samples = self.store.select(agent_id=agent_id, session_id=session_id)
        with self._lock:
            st = self._sessions.get(key)
            if st is None:
                st = SessionState(agent_id, session_id)
                if samples:
                    last = max(samples, key=lambda s: s.turn_index)
                    st.next_turn, st.last_sample_id, st.last_turn = last.turn_index + 1, last.id, last.turn_index
            self._touch(st)
            return st

    def known(self, agent_id: str, session_id: str) -> bool:
        if (agent_id, session_id) in self._sessions:
            return True
        return bool(self.store.select(agent_id=agent_id, session_id=session_id, limit=1))

    # ---- derived sessions -----------------------------------------------------------------------------------
    def _match(self, query: Query) -> SessionState | None:
        """The open session `query` continues, strongest fingerprint first (call with the lock held)."""
        for kind, fp in query.candidates():
            bucket = self._tails.get((kind, fp), ())
            for st in bucket:  # the oldest of equals first: identical conversations pair up in order
                if st.tail is not None and query.continues(kind, st.tail):
                    return st
            if kind == "prompt" and query.lax and query.reply:  # the end user's own session, the reply rewritten
                return next((st for st in bucket if st.tail is not None and st.tail.reply), None)
        return None

    def claim(self, query: Query, create: bool = True) -> tuple[SessionState | None, Tail | None]:
        """The open session `query` continues (its tail taken, so no other request claims the same state), or a
        new derived session (None if not `create`). Returns the state and the tail it had (given back with
        `set_tail` if the turn fails)."""
        with self._lock:
            st = self._match(query)
            if st is not None:
                tail = st.tail
                self._unindex(st)
                st.tail = None
                self._touch(st)
                self.stats["derived_continued"] += 1
                return st, tail
            if not create:
                return None, None
            st = SessionState(query.agent_id, f"auto-{uuid.uuid4().hex[:16]}")
            self._touch(st)
            self.stats["derived_new"] += 1
            return st, None

    def recover(self, query: Query) -> SessionState | None:
        """A session forgotten by this process (restart, eviction) whose last stored turn this request extends.

        Reads the store (call off the event loop). Only the strongest match counts (the whole history), and only
        when that turn is still its session's last and the session is not live here (else it is a fork).
        """
        full = next((fp for kind, fp in query.candidates() if kind == "full"), None)
        if full is None or not query.reply:  # an empty reply continues nothing (`Query.continues`)
            return None
        for sample in reversed(self.store.by_conv_tail(full)):
            if (sample.agent_id, sample.session_id) in self._sessions:
                continue
            st = self.state(sample.agent_id, sample.session_id)
            if st.last_sample_id == sample.id:
                with self._lock:
                    self.stats["derived_recovered"] += 1
                return st
        return None

    def peek(self, query: Query) -> str | None:
        """The session `query` would continue, without claiming it (side turns)."""
        with self._lock:
            st = self._match(query)
            return st.session_id if st is not None else None

    def set_tail(self, st: SessionState, tail: Tail | None) -> None:
        """Record what the next request of `st`'s conversation extends (None: nothing to extend)."""
        with self._lock:
            self._unindex(st)
            st.tail = tail
            if tail is None or (st.agent_id, st.session_id) not in self._sessions:
                return  # evicted meanwhile: forgotten
            for key in tail.fingerprints():
                self._tails.setdefault(key, []).append(st)

    # ---- turns ----------------------------------------------------------------------------------------------
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
