"""The durable sample store: SQLite in WAL mode with `synchronous=FULL`, one row per captured main turn.

Life of a sample: `pending` (captured at `created_at`, waiting for its next state and score) → `ready` (scored
at `scored_at`, trainable) → `claimed` (in the batch of optimizer step `claimed_step`, claimed at `claimed_at`
while the server served adapter `served_version`; the sample itself came from `adapter_version`) → `consumed`
(a checkpoint covering that step exists). `dropped` samples are kept for inspection but never trained on
(`meta.dropped` says why). Which ready samples a step claims: `metaclaw.store.claims` (newest first, bounded
staleness). After a crash, `reconcile(step)`
releases claims the restored checkpoint does not cover, so unconsumed samples are trained on and none twice.

Writes go through one connection (one transaction each; `write_batch` groups many into one fsync, which is how
`GroupCommitWriter` serves concurrent proxy turns); reads use a second connection, so in WAL mode they never
wait behind a writer's fsync.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from array import array
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from metaclaw.store.claims import LAST_TRAINED_SQL, LIGHT_READY_SQL, plan_claim
from metaclaw.store.meta import SampleMeta
from metaclaw.store.migrations import migrate

STATUSES = ("pending", "ready", "claimed", "consumed", "dropped")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    agent_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    prompt_ids BLOB NOT NULL,
    response_ids BLOB NOT NULL,
    behaviour_logprobs BLOB NOT NULL,
    teacher_logprobs BLOB,
    reward REAL,
    adapter_version INTEGER NOT NULL,
    temperature REAL NOT NULL,
    status TEXT NOT NULL,
    claimed_step INTEGER,
    next_state TEXT,
    messages TEXT,
    response_text TEXT,
    meta TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    scored_at REAL,
    claimed_at REAL,
    served_version INTEGER
);
CREATE INDEX IF NOT EXISTS samples_status ON samples(status, id);
CREATE INDEX IF NOT EXISTS samples_session ON samples(agent_id, session_id, turn_index);
CREATE INDEX IF NOT EXISTS samples_response_id ON samples(json_extract(meta, '$.response_id'));
CREATE INDEX IF NOT EXISTS samples_conv_tail ON samples(json_extract(meta, '$.conv_tail'));
"""
MAX_DEFERRALS = 1  # times a sample may be handed back by a zero-advantage step (`SampleStore.defer`)
# What a replayed distilled reply copies of its original row (`SampleStore._replay_distilled`).
REPLAY_COLUMNS = (
    "agent_id, session_id, turn_index, prompt_ids, response_ids, behaviour_logprobs, teacher_logprobs, reward,"
    " adapter_version, temperature, next_state, messages, response_text, created_at, scored_at"
)
# A store written by an older version is migrated when opened (`metaclaw.store.migrations`, PRAGMA user_version).
# Explicit feedback (`/v1/feedback`) may reopen a scored sample that was not trained on: ready ones, and ones
# dropped only because the judge gave no signal or failed (the feedback is a signal).
REOPENABLE_DROPS = ("no_hint", "no_reward", "no_next_state", "no_verdict", "judge_failed")
# A reaction (next state) that arrives after its turn was settled `dropped: no_next_state` (its session went idle
# first: `rollout.scoring` `session_idle_s`) reopens the turn when the reply is at most this old: the scorer then
# judges the late reaction like any other. Older turns stay dropped (their adapter version is long gone).
LATE_REACTION_MAX_AGE_S = 3600.0
# Set the next state; a turn dropped for want of one, young enough, goes back to `pending` (meta.late_reaction).
_SET_NEXT_STATE = """UPDATE samples SET next_state=:text, updated_at=:now,
 status=CASE WHEN {reopen} THEN 'pending' ELSE status END,
 meta=CASE WHEN {reopen} THEN json_set(json_remove(meta, '$.dropped'), '$.late_reaction', :now - created_at)
 ELSE meta END
WHERE id=:id""".format(
    reopen="status='dropped' AND json_extract(meta, '$.dropped')='no_next_state' AND :now - created_at <= :max_age"
)


BACKLOG_POLICIES = ("drop_oldest", "pause_capture")


class SampleScreen(Protocol):
    """What the store applies to every sample and next state before writing them (`metaclaw.privacy`)."""

    def screen(self, sample: Sample) -> Sample: ...

    def screen_next_state(self, text: str) -> str: ...


class SampleValidationError(ValueError):
    """A sample that cannot be trained on; the message names the offending fields."""


class BacklogFull(ValueError):
    """Capture is paused: the backlog (pending + ready samples) is at `max_backlog` (`backlog_policy=pause_capture`)."""


@dataclass
class SampleText:
    """A turn's words, as the judge reads them and the privacy screen redacts them (each a column of its own):
    the conversation the request carried, the reply's text, and what the user said next (None: not yet)."""

    messages: list[dict[str, Any]] | None = None
    response_text: str | None = None
    next_state: str | None = None


@dataclass
class Sample:
    """One main turn: the prompt as the server rendered it, the sampled response, and its training signal.

    Token and logprob lists are aligned: `behaviour_logprobs[i]` (and `teacher_logprobs[i]`) is the logprob of
    `response_ids[i]`. `temperature` is the sampler's, so the trainer recomputes logprobs over the same
    distribution (stored once: this column; `meta.sampling` holds top-p and top-k). `text` is the turn's words
    (`SampleText`: messages, reply, next state); `meta` is a `SampleMeta` (a dict given here becomes one). The
    groups are records in Python only: each of their fields is still a column of its own.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    agent_id: str = "default"
    session_id: str = "default"
    turn_index: int = 0
    adapter_version: int = 0
    temperature: float = 1.0
    reward: float | None = None
    teacher_logprobs: list[float] | None = None
    status: str = "pending"
    text: SampleText = field(default_factory=SampleText)
    meta: SampleMeta = field(default_factory=SampleMeta)
    claimed_step: int | None = None
    id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.meta, SampleMeta):
            self.meta = SampleMeta.of(self.meta)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def validate(self) -> None:
        """Raise `SampleValidationError` naming the fields that make this sample unusable."""
        n = len(self.response_ids)
        if not self.prompt_ids:
            raise SampleValidationError("prompt_ids is empty")
        if n == 0:
            raise SampleValidationError("response_ids is empty")
        if len(self.behaviour_logprobs) != n:
            raise SampleValidationError(
                f"behaviour_logprobs has {len(self.behaviour_logprobs)} entries but response_ids has {n}"
            )
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise SampleValidationError(
                f"teacher_logprobs has {len(self.teacher_logprobs)} entries but response_ids has {n}"
            )
        for name in ("prompt_ids", "response_ids"):
            if not _token_ids_ok(getattr(self, name)):
                raise SampleValidationError(f"{name} must be non-negative integers")
        for name in ("behaviour_logprobs", "teacher_logprobs"):
            values = getattr(self, name)
            if values is not None and not _finite_ok(values):
                raise SampleValidationError(f"{name} must be finite numbers")
        if self.reward is not None and not math.isfinite(self.reward):
            raise SampleValidationError("reward must be finite")
        if not self.temperature > 0:
            raise SampleValidationError("temperature must be > 0")
        if self.status not in STATUSES:
            raise SampleValidationError(f"status must be one of {STATUSES}, got {self.status!r}")


def _token_ids_ok(ids: Sequence[Any]) -> bool:
    """All non-negative ints (bools refused); C-speed for the usual plain-`int` lists of long prompts."""
    if set(map(type, ids)) <= {int}:
        return not ids or min(ids) >= 0
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)


def _finite_ok(values: Sequence[Any]) -> bool:
    if set(map(type, values)) <= {float, int}:
        return all(map(math.isfinite, values))
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


_INSERT = (
    "INSERT INTO samples (agent_id, session_id, turn_index, prompt_ids, response_ids, behaviour_logprobs,"
    " teacher_logprobs, reward, adapter_version, temperature, status, next_state, messages,"
    " response_text, meta, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
)


def _insert_row(sample: Sample, now: float) -> tuple:
    return (
        sample.agent_id,
        sample.session_id,
        sample.turn_index,
        _ints(sample.prompt_ids),
        _ints(sample.response_ids),
        _floats(sample.behaviour_logprobs),
        _floats(sample.teacher_logprobs),
        sample.reward,
        sample.adapter_version,
        sample.temperature,
        sample.status,
        sample.text.next_state,
        None if sample.text.messages is None else json.dumps(sample.text.messages),
        sample.text.response_text,
        json.dumps(_stored_meta(sample.meta)),
        now,
        now,
    )


def _stored_meta(meta: SampleMeta) -> dict[str, Any]:
    """`meta` as stored: the temperature lives in its column only."""
    stored = meta.to_dict()
    if isinstance(stored.get("sampling"), dict) and "temperature" in stored["sampling"]:
        stored["sampling"] = {k: v for k, v in stored["sampling"].items() if k != "temperature"}
    return stored


def _read_meta(text: str, temperature: float) -> SampleMeta:
    """A stored meta as a record; `sampling` gets the column's temperature (the whole distribution)."""
    meta = SampleMeta.of(json.loads(text))
    if isinstance(meta.sampling, dict):
        meta.sampling = {"temperature": temperature, **meta.sampling}
    return meta


def _ints(values: Sequence[int]) -> bytes:
    return array("i", values).tobytes()


def _floats(values: Sequence[float] | None) -> bytes | None:
    return None if values is None else array("d", values).tobytes()


def _unpack(blob: bytes | None, code: str) -> list | None:
    if blob is None:
        return None
    out = array(code)
    out.frombytes(blob)
    return out.tolist()


class SampleStore:
    """Thread-safe access to the sample database; several processes may open the same file.

    Args:
        path: the SQLite file (created with its parent directory if missing).
        busy_timeout_s: how long a writer waits for another process's lock.
        capture_limit: with it, `check_backlog()` (called by `GroupCommitWriter.submit` for new turns) refuses
            new samples while this many are pending or ready (`data.backlog_policy=pause_capture`).
        screen: applied to every new sample and next state before it is written (`metaclaw.privacy`: secrets and
            personal data never reach the file).
    """

    def __init__(
        self,
        path: str | Path,
        busy_timeout_s: float = 30.0,
        capture_limit: int | None = None,
        screen: SampleScreen | None = None,
        late_reaction_max_age_s: float = LATE_REACTION_MAX_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if capture_limit is not None and capture_limit < 1:
            raise ValueError(f"data.max_backlog must be >= 1 or null, got {capture_limit}")
        self.capture_limit, self.screen = capture_limit, screen
        self.late_reaction_max_age_s, self.clock = late_reaction_max_age_s, clock
        self.stats = {"capture_paused": 0}
        self._backlog_seen = (0, -1.0)  # (pending + ready, when counted): counted at most every 0.5 s
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)
        self._conn = self._connect(busy_timeout_s)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(_SCHEMA)
        migrate(self._conn, self.path)
        # Reads get their own connection (opened on first read): a WAL reader sees the last commit and never
        # waits for the writer's fsync.
        self._busy_timeout_s = busy_timeout_s
        self._read_lock = threading.Lock()
        self._reader_conn: sqlite3.Connection | None = None

    def _connect(self, busy_timeout_s: float) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA synchronous=FULL")
        return conn

    def close(self) -> None:
        with self._lock, self._read_lock:
            self._conn.close()
            if self._reader_conn is not None:
                self._reader_conn.close()

    @property
    def _reader(self) -> sqlite3.Connection:
        """The read connection; call with `_read_lock` held."""
        if self._reader_conn is None:
            self._reader_conn = self._connect(self._busy_timeout_s)
        return self._reader_conn

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; `BEGIN IMMEDIATE` takes the write lock up front so claims never race."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # ---- writes -------------------------------------------------------------------------------------------
    def insert(self, sample: Sample) -> int:
        """Validate and durably store a sample; returns its id."""
        return self.write_batch([sample])[0]

    def insert_many(self, samples: Sequence[Sample]) -> list[int]:
        """Validate every sample first, then store them all in one durable transaction (all or nothing).

        Returns their ids in order (also set on each sample). One `SampleValidationError` refuses the lot.
        """
        return self.write_batch(samples)

    def write_batch(
        self,
        samples: Sequence[Sample] = (),
        next_states: Sequence[tuple[int, str]] = (),
        validate: bool = True,
    ) -> list[int]:
        """New samples and `(sample_id, next_state)` updates in one transaction, i.e. one fsync: a group commit.

        `validate=False` is for callers that validated each sample already (`GroupCommitWriter` does, on the
        submitting thread). Ids are set on the samples only once the COMMIT has returned.
        """
        if validate:
            for sample in samples:
                sample.validate()
        if self.screen is not None:
            samples = [self.screen.screen(s) for s in samples]
            next_states = [(i, self.screen.screen_next_state(t)) for i, t in next_states]
        now = self.clock()
        rows = [_insert_row(s, now) for s in samples]  # serialise before taking the write lock
        with self._tx() as c:
            ids = [c.execute(_INSERT, row).lastrowid for row in rows]
            if next_states:
                c.executemany(_SET_NEXT_STATE, [self._next_state_row(i, text, now) for i, text in next_states])
        for sample, sample_id in zip(samples, ids, strict=True):
            sample.id = sample_id
        if any(s.status == "ready" for s in samples):
            with self._lock:
                self._ready.notify_all()
        return ids

    def set_next_state(self, sample_id: int, next_state: str) -> None:
        if self.screen is not None:
            next_state = self.screen.screen_next_state(next_state)
        with self._tx() as c:
            c.execute(_SET_NEXT_STATE, self._next_state_row(sample_id, next_state, self.clock()))

    def _next_state_row(self, sample_id: int, text: str, now: float) -> dict[str, Any]:
        """Parameters of `_SET_NEXT_STATE`: a late reaction reopens a turn dropped for want of one (bounded age)."""
        return {"id": sample_id, "text": text, "now": now, "max_age": self.late_reaction_max_age_s}

    def set_score(
        self,
        sample_id: int,
        *,
        reward: float | None = None,
        teacher_logprobs: Sequence[float] | None = None,
        status: str = "ready",
        meta: dict[str, Any] | None = None,
        expect_meta: dict[str, Any] | None = None,
    ) -> bool:
        """Record a scorer's verdict and move the sample to `ready` (or `dropped`).

        Non-finite teacher logprobs or rewards raise `SampleValidationError` naming the field (one NaN would
        become a NaN loss): nothing is written. With `expect_meta`, nothing is written (and False returned)
        unless the stored meta still has those values (a missing key reads as None): e.g. no feedback arrived
        while the scorer worked.
        """
        if status not in ("ready", "dropped"):
            raise ValueError(f"status must be 'ready' or 'dropped', got {status!r}")
        if teacher_logprobs is not None and not _finite_ok(teacher_logprobs):
            raise SampleValidationError("teacher_logprobs must be finite numbers")
        if reward is not None and not (isinstance(reward, int | float) and math.isfinite(reward)):
            raise SampleValidationError("reward must be finite")
        with self._tx() as c:
            row = c.execute("SELECT response_ids, meta FROM samples WHERE id=?", (sample_id,)).fetchone()
            if row is None:
                raise KeyError(f"no sample with id {sample_id}")
            stored = json.loads(row["meta"])
            if expect_meta and any(stored.get(k) != v for k, v in expect_meta.items()):
                return False
            n = len(_unpack(row["response_ids"], "i"))
            if teacher_logprobs is not None and len(teacher_logprobs) != n:
                raise SampleValidationError(
                    f"teacher_logprobs has {len(teacher_logprobs)} entries but response_ids has {n}"
                )
            merged = {**stored, **(meta or {})}
            now = time.time()
            c.execute(
                "UPDATE samples SET reward=COALESCE(?, reward), teacher_logprobs=COALESCE(?, teacher_logprobs),"
                " status=?, meta=?, updated_at=?, scored_at=? WHERE id=?",
                (reward, _floats(teacher_logprobs), status, json.dumps(merged), now, now, sample_id),
            )
            if status == "ready":
                self._ready.notify_all()
        return True

    def note(self, sample_id: int, key: str, value: Any) -> None:
        """Record `value` (JSON) under `meta.<key>` of a sample whatever its status (e.g. what its distillation
        did, after the turn settled); `key` is a name the code chooses, never request data."""
        if not key.isidentifier():
            raise ValueError(f"a meta key must be a name, got {key!r}")
        with self._tx() as c:
            c.execute("UPDATE samples SET meta=json_set(meta, ?, json(?)), updated_at=? WHERE id=?",
                      (f"$.{key}", json.dumps(value), time.time(), sample_id))  # fmt: skip

    def add_feedback(self, sample_id: int, feedback: dict[str, Any]) -> tuple[str, str]:
        """Store `feedback` as the sample's `meta.feedback` (the latest wins); a sample scored but not trained
        on goes back to `pending` so the scorer settles it again with the feedback. Returns (status before,
        status after); `claimed`/`consumed` samples keep their status: they are trained on already."""
        with self._tx() as c:
            row = c.execute("SELECT status, meta FROM samples WHERE id=?", (sample_id,)).fetchone()
            if row is None:
                raise KeyError(f"no sample with id {sample_id}")
            before, meta = row["status"], json.loads(row["meta"])
            if self.screen is not None and isinstance(feedback.get("text"), str):
                feedback = {**feedback, "text": self.screen.screen_next_state(feedback["text"])}
            meta["feedback"] = feedback
            after = before
            if before == "ready" or (before == "dropped" and meta.get("dropped") in REOPENABLE_DROPS):
                after = "pending"
                meta.pop("dropped", None)
            c.execute(
                "UPDATE samples SET status=?, meta=?, updated_at=? WHERE id=?",
                (after, json.dumps(meta), time.time(), sample_id),
            )
        return before, after

    def check_backlog(self) -> None:
        """Raise `BacklogFull` while capture is paused (pending + ready >= `capture_limit`); counted."""
        if self.capture_limit is None:
            return
        n, when = self._backlog_seen
        now = time.monotonic()
        if now - when > 0.5:
            n = self.backlog()
            self._backlog_seen = (n, now)
        if n >= self.capture_limit:
            self.stats["capture_paused"] += 1
            raise BacklogFull(
                f"capture paused: {n} samples wait to be trained (data.max_backlog={self.capture_limit}, "
                "data.backlog_policy=pause_capture)"
            )

    def backlog(self) -> int:
        """Samples captured but not yet trained on or dropped: pending + ready."""
        with self._read_lock:
            sql = "SELECT COUNT(*) FROM samples WHERE status IN ('pending', 'ready')"
            return self._reader.execute(sql).fetchone()[0]

    # ---- training-side --------------------------------------------------------------------------------------
    def claim_batch(
        self,
        step: int,
        max_samples: int,
        max_tokens: int | None = None,
        max_sample_tokens: int | None = None,
        min_adapter_version: int | Mapping[str, int] | None = None,
        min_samples: int = 1,
        max_backlog: int | None = None,
        latest_skill_generation_only: bool = False,
        partition: Callable[[str], str] | None = None,
        partitions: Collection[str] | None = None,
        max_age_s: float | None = None,
        served_version: int | Mapping[str, int] | None = None,
    ) -> list[Sample]:
        """The samples of optimizer step `step`, newest first; idempotent, so every DDP rank gets the same batch.

        The first caller for a step claims the newest ready samples until `max_samples` or `max_tokens`
        (prompt + response) would be exceeded; later callers get the same rows. Every ready sample longer than
        `max_sample_tokens`, produced by an adapter older than `min_adapter_version` or captured more than
        `max_age_s` seconds ago (both `stale`), or gathered under an agent's older skill generation (with
        `latest_skill_generation_only`) is settled `dropped` with its reason (`metaclaw.store.claims`).
        Nothing is claimed while fewer than `min_samples` would be (e.g. one per DDP rank). With `max_backlog`
        (`data.backlog_policy=drop_oldest`), the oldest ready samples beyond that many are dropped first
        (`backlog`). With `partition` (agent id -> adapter, docs/agents.md) a batch holds one adapter's samples:
        of the adapters with at least `min_samples` fresh ones, the one whose oldest waited longest; others wait
        for their own step. `min_adapter_version` and `served_version` may then map each adapter to its own
        value. With `partitions`, only those adapters' samples are claimed (outside a training window: the
        agents that train anyway). Each claimed sample records `claimed_at` and `served_version` (the adapter
        version served when it was claimed: its staleness at training is `served_version - adapter_version`).
        """
        with self._tx() as c:
            rows = c.execute("SELECT * FROM samples WHERE status='claimed' AND claimed_step=? ORDER BY id DESC",
                             (step,))  # fmt: skip
            claimed = [self._row(r) for r in rows.fetchall()]
            if claimed:
                return claimed
            now = time.time()
            if max_backlog is not None:
                c.execute(
                    "UPDATE samples SET status='dropped', meta=json_set(meta, '$.dropped', 'backlog'), updated_at=?"
                    " WHERE id IN (SELECT id FROM samples WHERE status='ready' ORDER BY id LIMIT max(0,"
                    " (SELECT COUNT(*) FROM samples WHERE status='ready') - ?))",
                    (now, max_backlog),
                )
            plan = plan_claim(
                c.execute(LIGHT_READY_SQL, (array("i").itemsize,)).fetchall(),
                now,
                max_samples,
                max_tokens=max_tokens,
                max_sample_tokens=max_sample_tokens,
                min_adapter_version=min_adapter_version,
                max_age_s=max_age_s,
                min_samples=min_samples,
                generations=self._latest_skill_generations(c) if latest_skill_generation_only else None,
                partition=partition,
                partitions=partitions,
                served_version=served_version,
                last_trained=dict(c.execute(LAST_TRAINED_SQL).fetchall()) if partition is not None else None,
            )
            c.executemany(
                "UPDATE samples SET status='dropped', meta=json_set(meta, '$.dropped', ?), updated_at=? WHERE id=?",
                [(reason, now, sample_id) for sample_id, reason in plan.drops],
            )
            if not plan.batch:
                return []
            c.executemany(
                "UPDATE samples SET status='claimed', claimed_step=?, claimed_at=?, served_version=?, updated_at=?"
                " WHERE id=?",
                [(step, now, plan.served[i], now, i) for i in plan.batch],
            )
            marks = ",".join("?" * len(plan.batch))
            self._replay_distilled(c, plan.batch, now)
            rows = c.execute(f"SELECT * FROM samples WHERE id IN ({marks}) ORDER BY id DESC", plan.batch)
            return [self._row(r) for r in rows.fetchall()]

    @staticmethod
    def _replay_distilled(c: sqlite3.Connection, ids: Sequence[int], now: float) -> None:
        """Distilled replies (`meta.distilled`, a cross-entropy row: no ratio, no reward) with replays left
        (`distill.distiller.replays`) are copied as `ready` when claimed, with one replay fewer, so each is trained
        in that many later steps too; the copy keeps the original's capture time (`data.max_age_s` bounds it
        as it bounds the original; no version bound applies to distilled rows: `store.claims`), and the claimed
        original keeps none left, so a released claim is never copied twice."""
        marks = ",".join("?" * len(ids))
        left = "CAST(json_extract(meta, '$.distilled.replays_left') AS INTEGER)"
        which = f"id IN ({marks}) AND json_type(meta, '$.distilled') = 'object' AND {left} > 0"
        c.execute(
            f"INSERT INTO samples ({REPLAY_COLUMNS}, status, meta, updated_at) SELECT {REPLAY_COLUMNS}, 'ready',"
            f" json_set(meta, '$.distilled.replays_left', {left} - 1), ? FROM samples WHERE {which} ORDER BY id",
            (now, *ids),
        )
        c.execute(f"UPDATE samples SET meta = json_set(meta, '$.distilled.replays_left', 0) WHERE {which}", tuple(ids))

    @staticmethod
    def _latest_skill_generations(c: sqlite3.Connection) -> dict[str, int]:
        """Each agent's newest `meta.skill_generation` over every captured sample (pending ones included)."""
        rows = c.execute(
            "SELECT agent_id, MAX(CAST(json_extract(meta, '$.skill_generation') AS INTEGER)) FROM samples"
            " WHERE json_type(meta, '$.skill_generation') = 'integer' GROUP BY agent_id"
        ).fetchall()
        return {r[0]: r[1] for r in rows}

    def release_claims(self, step: int) -> int:
        """Hand the samples claimed for `step` back as `ready` (an abandoned step); returns how many."""
        with self._tx() as c:
            released = c.execute(
                "UPDATE samples SET status='ready', claimed_step=NULL, claimed_at=NULL, served_version=NULL,"
                " updated_at=? WHERE status='claimed' AND claimed_step=?",
                (time.time(), step),
            ).rowcount
            if released:
                self._ready.notify_all()
        return released

    def defer(self, sample_ids: Sequence[int]) -> int:
        """The claimed samples of a step that took no gradient (all advantages zero: equal rewards) go back to
        `ready` with `meta.deferred` counted, so a later batch trains them beside other rewards
        (`claims.plan_claim`: deferred first, never alone); returns how many. A sample is handed back at most
        `MAX_DEFERRALS` times: a second zero-advantage batch (every reward equal again) consumes it, so a run of
        equal verdicts never cycles the same samples through skipped steps."""
        ids = [int(i) for i in sample_ids]
        if not ids:
            return 0
        with self._tx() as c:
            marks = ",".join("?" * len(ids))
            deferred = c.execute(
                "UPDATE samples SET status='ready', claimed_step=NULL, claimed_at=NULL, served_version=NULL,"
                " meta=json_set(meta, '$.deferred', COALESCE(json_extract(meta, '$.deferred'), 0) + 1), updated_at=?"
                f" WHERE status='claimed' AND COALESCE(json_extract(meta, '$.deferred'), 0) < {MAX_DEFERRALS}"
                f" AND id IN ({marks})",
                (time.time(), *ids),
            ).rowcount
            if deferred:
                self._ready.notify_all()
        return deferred

    def mark_consumed(self, below_step: int) -> int:
        """A checkpoint after `below_step` optimizer steps exists: claims of earlier steps are consumed."""
        with self._tx() as c:
            cur = c.execute(
                "UPDATE samples SET status='consumed', updated_at=? WHERE status='claimed' AND claimed_step<?",
                (time.time(), below_step),
            )
            return cur.rowcount

    def reconcile(self, global_step: int) -> dict[str, int]:
        """On (re)start from a checkpoint at `global_step`: consume what it covers, release the rest."""
        consumed = self.mark_consumed(global_step)
        with self._tx() as c:
            released = c.execute(
                "UPDATE samples SET status='ready', claimed_step=NULL, claimed_at=NULL, served_version=NULL,"
                " updated_at=? WHERE status='claimed' AND claimed_step>=?",
                (time.time(), global_step),
            ).rowcount
            if released:
                self._ready.notify_all()
        return {"consumed": consumed, "released": released}

    def wait_for_ready(self, timeout: float, poll_s: float = 0.05) -> bool:
        """Block until a ready sample exists or `timeout` passes (woken at once by inserts in this process)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                if self.count("ready"):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # Other processes cannot notify us; re-check at a modest interval.
                self._ready.wait(min(left, poll_s * 10))

    # ---- reads ----------------------------------------------------------------------------------------------
    def get(self, sample_id: int) -> Sample:
        with self._read_lock:
            row = self._reader.execute("SELECT * FROM samples WHERE id=?", (sample_id,)).fetchone()
        if row is None:
            raise KeyError(f"no sample with id {sample_id}")
        return self._row(row)

    def select(self, status: str | None = None, limit: int | None = None, **where: Any) -> list[Sample]:
        """Samples filtered by status and equality on columns (e.g. `session_id=...`), in id order."""
        clauses, args = [], []
        if status is not None:
            clauses.append("status=?")
            args.append(status)
        for col, value in where.items():
            if col not in ("agent_id", "session_id", "turn_index", "adapter_version", "claimed_step"):
                raise ValueError(f"cannot filter samples on {col!r}")
            clauses.append(f"{col}=?")
            args.append(value)
        sql = "SELECT * FROM samples" + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._read_lock:
            rows = self._reader.execute(sql, args).fetchall()
        return [self._row(r) for r in rows]

    def by_response_id(self, response_id: str) -> list[Sample]:
        """The samples whose `meta.response_id` is `response_id` (the reply id the proxy gave the client)."""
        return self._by_meta("response_id", response_id)

    def by_conv_tail(self, fingerprint: str) -> list[Sample]:
        """The samples whose `meta.conv_tail` is `fingerprint` (the conversation as it stood after their reply)."""
        return self._by_meta("conv_tail", fingerprint)

    def _by_meta(self, key: str, value: str) -> list[Sample]:
        sql = f"SELECT * FROM samples WHERE json_extract(meta, '$.{key}')=? ORDER BY id"  # key: ours, indexed
        with self._read_lock:
            rows = self._reader.execute(sql, (value,)).fetchall()
        return [self._row(r) for r in rows]

    def missing(self, ids: Sequence[int]) -> set[int]:
        """The ids in `ids` no longer in the store (deleted by `forget`: a claimed batch holding one is dropped)."""
        wanted = sorted({int(i) for i in ids})
        if not wanted:
            return set()
        with self._read_lock:
            rows = self._reader.execute(f"SELECT id FROM samples WHERE id IN ({','.join('?' * len(wanted))})", wanted)
            return set(wanted) - {r[0] for r in rows.fetchall()}

    def count(self, status: str | None = None) -> int:
        with self._read_lock:
            if status is None:
                return self._reader.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
            return self._reader.execute("SELECT COUNT(*) FROM samples WHERE status=?", (status,)).fetchone()[0]

    def dropped_reasons(self) -> dict[str, int]:
        """How many samples were dropped, by reason (`meta.dropped` up to its first `:`, e.g. `stale`)."""
        sql = (
            "SELECT CASE WHEN instr(d, ':') > 0 THEN substr(d, 1, instr(d, ':') - 1) ELSE coalesce(d, 'unknown') END"
            " AS reason, COUNT(*) FROM (SELECT json_extract(meta, '$.dropped') AS d FROM samples"
            " WHERE status='dropped') GROUP BY reason"
        )
        with self._read_lock:
            return {r[0]: r[1] for r in self._reader.execute(sql).fetchall()}

    def rates(self, window_s: float = 300.0, now: float | None = None) -> dict[str, float | None]:
        """Serving and training pace over the last `window_s` seconds, from the store alone.

        `replies_per_min` / `reply_tokens_per_s`: main turns captured (the agent's replies) and their tokens;
        `trained_per_min`: samples claimed by optimizer steps; `trained_age_s` / `trained_lag`: the median age
        (seconds from capture to training) and version lag (`served_version - adapter_version`) of those.
        """
        now = time.time() if now is None else now
        since = now - window_s
        with self._read_lock:
            replies, tokens = self._reader.execute(
                "SELECT COUNT(*), COALESCE(SUM(length(response_ids)), 0) / ? FROM samples WHERE created_at >= ?",
                (array("i").itemsize, since),
            ).fetchone()
            trained = self._reader.execute(
                "SELECT claimed_at - created_at, served_version - adapter_version FROM samples"
                " WHERE claimed_at >= ? AND status IN ('claimed', 'consumed')",
                (since,),
            ).fetchall()
        ages = sorted(r[0] for r in trained)
        lags = sorted(r[1] for r in trained if r[1] is not None)
        return {
            "window_s": window_s,
            "replies_per_min": replies * 60.0 / window_s,
            "reply_tokens_per_s": tokens / window_s,
            "trained_per_min": len(trained) * 60.0 / window_s,
            "trained_age_s": ages[len(ages) // 2] if ages else None,
            "trained_lag": lags[len(lags) // 2] if lags else None,
        }

    def counts(self) -> dict[str, int]:
        with self._read_lock:
            rows = self._reader.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall()
        return {s: 0 for s in STATUSES} | {r[0]: r[1] for r in rows}

    @staticmethod
    def _row(r: sqlite3.Row) -> Sample:
        return Sample(
            id=r["id"],
            agent_id=r["agent_id"],
            session_id=r["session_id"],
            turn_index=r["turn_index"],
            prompt_ids=_unpack(r["prompt_ids"], "i"),
            response_ids=_unpack(r["response_ids"], "i"),
            behaviour_logprobs=_unpack(r["behaviour_logprobs"], "d"),
            teacher_logprobs=_unpack(r["teacher_logprobs"], "d"),
            reward=r["reward"],
            adapter_version=r["adapter_version"],
            temperature=r["temperature"],
            status=r["status"],
            claimed_step=r["claimed_step"],
            text=SampleText(
                messages=None if r["messages"] is None else json.loads(r["messages"]),
                response_text=r["response_text"],
                next_state=r["next_state"],
            ),
            meta=_read_meta(r["meta"], r["temperature"]),
        )
