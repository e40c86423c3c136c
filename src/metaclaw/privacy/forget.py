"""Forgetting: delete a user's, an agent's or a session's turns down to the file bytes; retention of old samples.

`forget(...)` deletes the matching samples and session-log rows with SQLite's `secure_delete` on (deleted
content is overwritten with zeros), checkpoints the WAL with `TRUNCATE` (the log file is emptied) and `VACUUM`s
the file (no free page keeps an old copy), removes the skills evolved from those turns (matched through each
agent's evolution history: `source_sample_ids` of accepted changes, and `source_sample_ids` in a skill's own
metadata where present), and reports the optimizer steps that trained on them and the adapters that therefore
hold what they learnt, with the last adapter trained before them (the one to roll back to).
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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
    skills_removed: list[str] = field(default_factory=list)
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
            rows = conn.execute(f"SELECT id, agent_id, status, claimed_step FROM samples WHERE {where}", args)
            rows = rows.fetchall()
            ids = {r[0] for r in rows}
            by_agent: dict[str, set[int]] = {}
            for _id, agent_id, _status, _step in rows:
                by_agent.setdefault(agent_id, set()).add(_id)
            trained = [(a, k) for _i, a, status, k in rows if status in ("claimed", "consumed") and k is not None]
            report.samples_deleted = conn.execute(f"DELETE FROM samples WHERE {where}", args).rowcount
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
    if skills_root is not None and ids:
        report.skills_removed = remove_evolved_skills(Path(skills_root), by_agent)
    return report


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
        before = [s for s in steps if s <= k]
        report.rollback_to[name] = before[-1] if before else None


def remove_evolved_skills(skills_root: Path, by_agent: dict[str, set[int]]) -> list[str]:
    """Remove each agent's skills that an accepted evolution made from (or edited with) a forgotten sample.

    Provenance comes from the agent's `history.jsonl` (`source_sample_ids` of accepted `add`/`edit` entries) and,
    where present, `source_sample_ids` in the skill's own front matter. Sample ids are per store: a skills root
    shared by several runs' stores may match another run's turn with the same id (the safe side: removed)."""
    from metaclaw.skills.library import SkillLibrary

    removed = []
    for agent, ids in by_agent.items():
        if not (skills_root / agent).is_dir():
            continue
        library = SkillLibrary(skills_root, agent, seed_bank=False)
        names = set()
        for entry in library.history():
            sources = entry.get("source_sample_ids") or []
            from_forgotten = ids.intersection(s for s in sources if isinstance(s, int))
            if entry.get("accepted") and entry.get("name") and from_forgotten:
                names.add(entry["name"])
        for skill_dir in (skills_root / agent).iterdir():
            md = skill_dir / "SKILL.md"
            if md.is_file() and _front_matter_sources(md) & ids:
                names.add(skill_dir.name)
        for name in sorted(names):
            if (skills_root / agent / name).is_dir():
                try:
                    library.remove(name)
                except KeyError:
                    shutil.rmtree(skills_root / agent / name, ignore_errors=True)
                removed.append(f"{agent}/{name}")
    return removed


def _front_matter_sources(path: Path) -> set[int]:
    """`source_sample_ids` from a SKILL.md front matter (provenance written by the evolver, where it is)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return set()
    for line in text.split("---", 2)[1].splitlines() if text.startswith("---") else []:
        key, _, value = line.partition(":")
        if key.strip() in ("source_sample_ids", "sample_ids"):
            try:
                return {int(v) for v in json.loads(value.strip())}
            except (ValueError, TypeError):
                return set()
    return set()


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
