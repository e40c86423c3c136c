"""The ground floor: the durable sample store (SQLite), its group-commit writer and the session log.

Every other package may import `metaclaw.store`; it imports none of them. The proxy, the scorer, the trainer and
the tools open the store through `open_store` and its session log through `open_session_log`, so one place
decides how the file is opened.
"""

from __future__ import annotations

from pathlib import Path

from metaclaw.store.claims import ServedVersions
from metaclaw.store.meta import SampleMeta
from metaclaw.store.migrations import SCHEMA_VERSION, NewerStoreError
from metaclaw.store.samples import (
    BACKLOG_POLICIES,
    REOPENABLE_DROPS,
    STATUSES,
    BacklogFull,
    Sample,
    SampleScreen,
    SampleStore,
    SampleText,
    SampleValidationError,
)
from metaclaw.store.session_log import SessionLog
from metaclaw.store.writer import GroupCommitWriter

__all__ = [
    "BACKLOG_POLICIES",
    "SCHEMA_VERSION",
    "REOPENABLE_DROPS",
    "STATUSES",
    "BacklogFull",
    "GroupCommitWriter",
    "NewerStoreError",
    "Sample",
    "SampleMeta",
    "SampleScreen",
    "SampleStore",
    "SampleText",
    "SampleValidationError",
    "ServedVersions",
    "SessionLog",
    "open_session_log",
    "open_store",
]


def open_store(path: str | Path, capture_limit: int | None = None, screen: SampleScreen | None = None) -> SampleStore:
    """The sample store at `path` (created if missing); `capture_limit` pauses capture at that backlog; `screen`
    is applied to every sample written through it (`metaclaw.privacy.PrivacyPolicy`)."""
    return SampleStore(path, capture_limit=capture_limit, screen=screen)


def open_session_log(store: SampleStore) -> SessionLog:
    """The session log kept in the same file as `store` (its own connection: one per writer)."""
    return SessionLog(store.path)
