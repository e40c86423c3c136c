"""The store's schema version (`PRAGMA user_version`) and the migrations that bring an older file up to it.

A store opens, migrates in one transaction and keeps every row. Each migration is idempotent (another process may
have opened the same file a moment before) and numbered: migration `n` turns a version `n - 1` file into version `n`.
A file written by a newer metaclaw (a higher version) is refused with an error that says so.

| version | change |
|---|---|
| 0 | a file of the first releases (no `user_version`) |
| 1 | columns added after the first release: `scored_at`, `claimed_at`, `served_version` (NULL for old rows) |
| 2 | the sampling temperature is stored once, in the `temperature` column: removed from `meta.sampling` |
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

ADDED_COLUMNS = {"scored_at": "REAL", "claimed_at": "REAL", "served_version": "INTEGER"}


class NewerStoreError(RuntimeError):
    """The store file was written by a newer metaclaw (its schema version is higher than this one knows)."""


def _missing_columns(conn: sqlite3.Connection) -> list[str]:
    have = {r[1] for r in conn.execute("PRAGMA table_info(samples)")}
    return [column for column in ADDED_COLUMNS if column not in have]


def _add_columns(conn: sqlite3.Connection) -> None:
    for column in _missing_columns(conn):
        conn.execute(f"ALTER TABLE samples ADD COLUMN {column} {ADDED_COLUMNS[column]}")  # ours, not input


def _temperature_once(conn: sqlite3.Connection) -> None:
    conn.execute(
        "UPDATE samples SET meta=json_remove(meta, '$.sampling.temperature')"
        " WHERE json_type(meta, '$.sampling.temperature') IS NOT NULL"
    )


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_add_columns, _temperature_once]
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection, path: object = "") -> int:
    """Bring the store on `conn` (autocommit mode, tables created) to `SCHEMA_VERSION`; returns the version it
    had. One `BEGIN IMMEDIATE` transaction: a concurrent opener waits, then finds the work done. The columns of
    migration 1 are checked on every open (a file whose columns were dropped by hand gains them again)."""
    if conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION and not _missing_columns(conn):
        return SCHEMA_VERSION
    conn.execute("BEGIN IMMEDIATE")
    try:
        found = conn.execute("PRAGMA user_version").fetchone()[0]
        if found > SCHEMA_VERSION:
            raise NewerStoreError(f"the sample store {path} has schema version {found}; this metaclaw knows up to "
                                  f"{SCHEMA_VERSION}: open it with the metaclaw that wrote it")  # fmt: skip
        for migration in MIGRATIONS[min(found, SCHEMA_VERSION) :]:
            migration(conn)
        _add_columns(conn)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")  # a constant of ours
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return found
