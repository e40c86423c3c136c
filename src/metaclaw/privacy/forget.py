"""Forgetting: delete a user's, an agent's or a session's turns down to the file bytes; retention of old samples.

`forget(...)` deletes the matching samples and session-log rows with SQLite's `secure_delete` on (deleted
content is overwritten with zeros), checkpoints the WAL with `TRUNCATE` (the log file is emptied) and `VACUUM`s
the file (no free page keeps an old copy), removes the skills evolved from those turns (matched through each
agent's evolution history: `source_sample_ids` of accepted changes, and `source_sample_ids` in a skill's own
metadata where present), and reports the optimizer steps that trained on them and the adapters that therefore
hold what they learnt, with the last adapter trained before them (the one to roll back to).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from metaclaw.privacy.forget_copies import (
    MAX_SCRUB_BYTES,
    Quotes,
    injected_copies,
    remove_skills,
    sample_texts,
    scrub_text_files,
    skills_from,
)
from metaclaw.runfiles.layout import RunLayout

log = logging.getLogger(__name__)


@dataclass
class ForgetReport:
    """What `forget` did and what the user still has to decide (rolling back adapters trained on the turns)."""

    samples_deleted: int = 0
    session_rows_deleted: int = 0
    agents: list[str] = field(default_factory=list)
    trained_at_steps: list[int] = field(default_factory=list)
    adapters_trained_on_them: dict[str, list[int]] = field(default_factory=dict)
    rollback_to: dict[str, int | None] = field(default_factory=dict)
    adapter_paths: dict[str, list[str]] = field(default_factory=dict)  # the folders of adapters_trained_on_them
    rolled_back: dict[str, int] = field(default_factory=dict)  # --rollback: served now (0: the base model)
    adapters_removed: list[str] = field(default_factory=list)  # --rollback: the folders trained on the turns
    skills_removed: list[str] = field(default_factory=list)
    injected_copies_deleted: int = 0  # other turns whose prompt carried a skill made from the forgotten ones
    files_scrubbed: list[str] = field(default_factory=list)  # text files whose quoting lines were dropped
    claimed_now: list[int] = field(default_factory=list)  # forgotten samples the trainer held in a claimed batch
    wal_checkpoint: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_before(value: str) -> float:
    """`--before` as a Unix time: an ISO date or date-time (UTC unless it names a zone)."""
    try:
        when = datetime.fromisoformat(value)
    except ValueError as e:
        raise ValueError(f"--before must be an ISO date or date-time (e.g. 2026-11-01 or 2026-11-01T08:00), got "
                         f"{value!r}") from e  # fmt: skip
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def _where(agent: str | None, session: str | None, before: float | None, time_col: str) -> tuple[str, list[Any]]:
    clauses, args = [], []
    if agent is not None:
        clauses.append("agent_id=?")
        args.append(agent)
    if session is not None:
        clauses.append("session_id=?")
        args.append(session)
    if before is not None:
        clauses.append(f"{time_col}<?")
        args.append(before)
    if not clauses:
        raise ValueError("forget needs --agent, --session or --before")
    return " AND ".join(clauses), args


def purge(conn: sqlite3.Connection, vacuum: bool = True) -> list[int]:
    """After deletes with `secure_delete` on: empty the WAL (`TRUNCATE` checkpoint, retried while readers hold
    it) and rewrite the file (`VACUUM`), so no old copy of a deleted row survives in the log or a free page.
    Returns the checkpoint's `(busy, log frames, checkpointed frames)`."""
    result = [1, -1, -1]
    for _ in range(50):
        result = list(conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone())
        if result[0] == 0:
            break
        time.sleep(0.1)
    if vacuum:
        conn.execute("VACUUM")
        result = list(conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone())
    return result


def _connect(store_path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(store_path, timeout=30.0, isolation_level=None)
    conn.execute("PRAGMA secure_delete=ON")
    conn.execute("PRAGMA journal_mode=WAL")
    return conn


def forget(
    store_path: str | Path,
    *,
    agent: str | None = None,
    session: str | None = None,
    before: float | None = None,
    run_dir: str | Path | None = None,
    skills_root: str | Path | None = None,
) -> ForgetReport:
    """Delete the samples (and session-log rows) of `agent`, `session` and/or captured before `before` (Unix time;
    conditions combine with AND); see the module doc. `run_dir` (adapters) and `skills_root` are optional."""
    store_path = Path(store_path)
    if not store_path.is_file():
        raise FileNotFoundError(f"no sample store at {store_path}")
    report = ForgetReport()
    conn = _connect(store_path)
    try:
        where, args = _where(agent, session, before, "created_at")
        conn.execute("BEGIN IMMEDIATE")
        try:
            rows = conn.execute(f"SELECT id, agent_id, status, claimed_step, messages, response_text, next_state "
                                f"FROM samples WHERE {where}", args).fetchall()  # fmt: skip
            ids = {r[0] for r in rows}
            by_agent: dict[str, set[int]] = {}
            for r in rows:
                by_agent.setdefault(r[1], set()).add(r[0])
            quotes = Quotes(t for r in rows for t in sample_texts(r[4], r[5], r[6]))
            skills = skills_from(Path(skills_root), by_agent) if skills_root is not None and ids else {}
            copies = _injected(conn, skills) - ids  # other turns whose prompt carried such a skill
            rows += (
                conn.execute(
                    f"SELECT id, agent_id, status, claimed_step, NULL, NULL, NULL FROM samples WHERE id "
                    f"IN ({','.join('?' * len(copies))})",
                    sorted(copies),
                ).fetchall()
                if copies
                else []
            )
            trained = [(r[1], r[3]) for r in rows if r[2] in ("claimed", "consumed") and r[3] is not None]
            report.claimed_now = sorted(r[0] for r in rows if r[2] == "claimed")
            report.samples_deleted = conn.execute(f"DELETE FROM samples WHERE {where}", args).rowcount
            report.injected_copies_deleted = _delete_ids(conn, copies)
            has_sessions = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='rollout_sessions'"
            ).fetchone()
            if has_sessions:
                s_where, s_args = _where(agent, session, before, "updated_at")
                report.session_rows_deleted = conn.execute(
                    f"DELETE FROM rollout_sessions WHERE {s_where}", s_args
                ).rowcount
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        try:
            report.wal_checkpoint = purge(conn)
        except sqlite3.OperationalError as e:  # the running service held the file past the busy timeout
            report.notes.append(f"the rows are deleted (zeroed) but the file could not be vacuumed now ({e}): run "
                                "forget again (it is idempotent) or stop the service first")  # fmt: skip
        if report.wal_checkpoint and report.wal_checkpoint[0] != 0:
            report.notes.append("a reader held the WAL: it was not truncated; run forget again")
    finally:
        conn.close()
    report.agents = sorted(by_agent)
    report.trained_at_steps = sorted({step for _a, step in trained})
    if run_dir is not None and trained:
        _adapters(Path(run_dir), trained, report)
    elif trained:
        report.notes.append("no --run-dir: the adapters trained on these turns were not looked up")
    if skills:
        report.skills_removed = remove_skills(Path(str(skills_root)), skills, by_agent)
    _scrub(report, quotes, run_dir, skills_root, store_path)
    _unreachable(report, run_dir)
    return report


def _injected(conn: sqlite3.Connection, skills: dict[str, set[str]]) -> set[int]:
    if not skills:
        return set()
    marks = ",".join("?" * len(skills))
    rows = conn.execute(f"SELECT id, agent_id, meta FROM samples WHERE agent_id IN ({marks})", sorted(skills))
    return injected_copies(rows.fetchall(), skills)


def _delete_ids(conn: sqlite3.Connection, ids: set[int]) -> int:
    if not ids:
        return 0
    return conn.execute(f"DELETE FROM samples WHERE id IN ({','.join('?' * len(ids))})", sorted(ids)).rowcount


def _scrub(report: ForgetReport, quotes: Quotes, run_dir: Any, skills_root: Any, store_path: Path) -> None:
    """Lines quoting the forgotten turns leave the run's text files (train.log, eval.jsonl, ...) and the skills
    root's; the store itself was purged above."""
    for root in {Path(p).resolve() for p in (run_dir, skills_root) if p is not None}:
        changed, too_large = scrub_text_files(root, quotes, skip=[store_path])
        report.files_scrubbed += changed
        report.notes += [f"{f}: over {MAX_SCRUB_BYTES >> 20} MiB, not rewritten: delete it" for f in too_large]


def _unreachable(report: ForgetReport, run_dir: Any) -> None:
    """Say what `forget` cannot erase here, and how to erase it there."""
    if report.claimed_now:
        report.notes.append(f"samples {report.claimed_now[:10]} were in a batch the trainer had already claimed: a "
                            "step that has not started drops that batch; the step under way may still train on "
                            "them: --rollback sends the trainer back to the clean adapter before it "
                            "publishes")  # fmt: skip
    if run_dir is None:
        return
    run = Path(run_dir)
    wandb = run / "wandb"
    if wandb.is_dir():
        report.notes.append(f"W&B: runs under {wandb} that were uploaded (online, or `wandb sync`) keep their copy "
                            "(logged metrics, media, artifacts) on the W&B server: delete the run or artifact there "
                            "(the run's page, or `wandb artifact rm ENTITY/PROJECT/NAME:VERSION`); the local "
                            "files were scrubbed above")  # fmt: skip
    checkpoints = sorted((run / "checkpoints").glob("*.ckpt")) if (run / "checkpoints").is_dir() else []
    if checkpoints and report.trained_at_steps:
        report.notes.append(f"checkpoints {[c.name for c in checkpoints][-5:]} hold weights trained on these turns; "
                            "with --rollback the trainer's next publish rewrites them from the clean "
                            "weights")  # fmt: skip


def _adapters(run_dir: Path, trained: list[tuple[str, int]], report: ForgetReport) -> None:
    """Adapters published after a step that trained on a forgotten sample hold what it taught; the newest one
    published at or before the first such step does not (a sample claimed at step k is in `step-(k+1)` on)."""
    first: dict[str, int] = {}
    for agent, step in trained:
        first[agent] = min(step, first.get(agent, step))
    layout = RunLayout(run_dir)
    folders = {"default": layout.adapters()}
    for agent in first:
        own = layout.adapters(agent)
        if own.path.is_dir():
            folders[agent] = own
    for name, folder in folders.items():
        relevant = [s for a, s in first.items() if (a == name) or (name == "default" and a not in folders)]
        if not relevant:
            continue
        k = min(relevant)
        steps = [version for version, _ in folder.versions()]
        report.adapters_trained_on_them[name] = [s for s in steps if s > k]
        report.adapter_paths[name] = [str(d) for s, d in folder.versions() if s > k]
        before = [s for s in steps if s <= k]
        report.rollback_to[name] = before[-1] if before else None


def remove_adapters(report: ForgetReport, adapter: str) -> list[str]:
    """After a rollback of `adapter` to its clean state: delete its published folders trained on the forgotten
    turns (their weights hold what the turns taught). Returns the folders removed."""
    import shutil

    removed = []
    for path in report.adapter_paths.get(adapter, []):
        if Path(path).is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def apply_retention(store_path: str | Path, days: float, now: float | None = None) -> int:
    """Delete trained (`consumed`) and `dropped` samples captured more than `days` ago, securely (see `purge`;
    no VACUUM: secure_delete already zeroes the deleted content and a live service should not stall on a
    rewrite). Returns how many were deleted."""
    cutoff = (now if now is not None else time.time()) - days * 86400.0
    conn = _connect(Path(store_path))
    try:
        n = conn.execute(
            "DELETE FROM samples WHERE status IN ('consumed', 'dropped') AND created_at<?", (cutoff,)
        ).rowcount
        if n:
            purge(conn, vacuum=False)
            log.info("Retention: deleted %d trained or dropped samples older than %g days", n, days)
        return n
    finally:
        conn.close()


class RetentionSweeper:
    """Applies `apply_retention` now and every `every_s` seconds on a daemon thread until `stop()`."""

    def __init__(self, store_path: str | Path, days: float, every_s: float = 3600.0) -> None:
        import threading

        self.store_path, self.days, self.every_s = store_path, days, every_s
        self.deleted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="retention", daemon=True)

    def start(self) -> RetentionSweeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self.deleted += apply_retention(self.store_path, self.days)
            except sqlite3.Error as e:  # a busy store: next time
                log.warning("Retention sweep of %s failed: %s", self.store_path, e)
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
