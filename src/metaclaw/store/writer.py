"""`GroupCommitWriter`: one background thread that commits concurrently submitted samples together.

A durable SQLite commit costs one fsync (milliseconds on a real disk). Committing each proxied turn on its own
makes concurrent turns queue behind each other's fsyncs; here every sample waiting when the thread is free goes
into the same transaction (`SampleStore.write_batch`), so 32 concurrent turns cost about one fsync, not 32.

Durability is unchanged: a caller's future resolves only after the COMMIT that stored its sample returned
(`synchronous=FULL`). Samples are validated on the submitting thread, so a bad one raises there and never joins
(or sinks) a batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from metaclaw.store.samples import Sample, SampleStore

log = logging.getLogger(__name__)


@dataclass
class _Write:
    """One queued write: a new sample, or the next state of an earlier one."""

    future: Future
    sample: Sample | None = None
    next_state: tuple[int, str] | None = None


class GroupCommitWriter:
    """Queue samples from any thread or event loop; a single writer thread commits them in groups.

    Args:
        store: the store to write to (its write connection is shared with the store's other writers).
        max_batch: the most writes in one transaction.
        name: the writer thread's name.
    """

    def __init__(self, store: SampleStore, max_batch: int = 256, name: str = "sample-writer") -> None:
        self.store, self.max_batch = store, max_batch
        self.stats = {"commits": 0, "writes": 0, "largest_batch": 0, "failed_batches": 0}
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._closing = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- submitting ---------------------------------------------------------------------------------------
    def submit(self, sample: Sample) -> Future[int]:
        """Validate `sample` (raising `SampleValidationError` here) and queue it; the future yields its id.

        Raises `BacklogFull` (a ValueError) while the store's backlog bound pauses capture.
        """
        sample.validate()
        if sample.status in ("pending", "ready"):
            self.store.check_backlog()
        return self._put(_Write(Future(), sample=sample))

    def submit_next_state(self, sample_id: int, next_state: str) -> Future[None]:
        """Queue `store.set_next_state(sample_id, next_state)` to commit with the next group."""
        return self._put(_Write(Future(), next_state=(sample_id, next_state)))

    def insert(self, sample: Sample, timeout: float | None = None) -> int:
        """Blocking `submit`: the sample's id once it is durable."""
        return self.submit(sample).result(timeout)

    async def ainsert(self, sample: Sample) -> int:
        """`submit` for event loops: awaits the commit without blocking the loop."""
        return await asyncio.wrap_future(self.submit(sample))

    def _put(self, write: _Write) -> Future:
        with self._closing:
            if self._closed:
                raise RuntimeError("the GroupCommitWriter is closed")
            self._queue.put(write)
        return write.future

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Commit everything already submitted, then stop the thread; later submits raise `RuntimeError`."""
        with self._closing:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        self._thread.join(timeout)

    def __enter__(self) -> GroupCommitWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the writer thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is None:  # close() enqueues the sentinel after every accepted write
                stopping = True
                batch.pop()
            if batch:
                self._commit(batch)

    def _commit(self, batch: list[_Write]) -> None:
        for w in batch:
            # A caller that stopped waiting (e.g. its client went away) still gets its turn stored.
            w.future.set_running_or_notify_cancel()
        try:
            ids = self._write(batch)
        except Exception as e:  # one bad write must not fail its neighbours: retry them one by one
            if len(batch) == 1:
                self._fail(batch[0], e)
                return
            self.stats["failed_batches"] += 1
            log.warning("Group commit of %d writes failed (%s); retrying them one by one", len(batch), e)
            for w in batch:
                try:
                    self._resolve([w], self._write([w]))
                except Exception as one:
                    self._fail(w, one)
            return
        self._resolve(batch, ids)

    def _write(self, batch: list[_Write]) -> list[int]:
        samples = [w.sample for w in batch if w.sample is not None]
        next_states = [w.next_state for w in batch if w.next_state is not None]
        ids = self.store.write_batch(samples, next_states, validate=False)
        self.stats["commits"] += 1
        self.stats["writes"] += len(batch)
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
        return ids

    @staticmethod
    def _resolve(batch: list[_Write], ids: list[int]) -> None:
        it = iter(ids)
        for w in batch:
            if not w.future.cancelled():
                w.future.set_result(next(it) if w.sample is not None else None)
            elif w.sample is not None:
                next(it)

    @staticmethod
    def _fail(write: _Write, error: Exception) -> None:
        log.error("Sample write failed: %s", error)
        if not write.future.cancelled():
            write.future.set_exception(error)
