"""Tinker futures: every training call answers a request id at once; the client polls `retrieve_future`.

`FutureStore` keeps each future's result until it is retrieved (then `retrieved_grace_s` longer, for a client
that retries a poll) or until `result_ttl_s` passes unretrieved; at most `max_futures` are kept (the oldest finished
ones are dropped first; with none finished a new request is a 429, which the SDK backs off and retries).
`ModelQueue` runs one training model's requests strictly in `seq_id` order, whatever order they arrive in
(the SDK sends chunks of one batch concurrently); a resent `seq_id` answers the request id it already has.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from metaclaw.training_server.errors import ApiError

log = logging.getLogger(__name__)

Job = Callable[[], Awaitable[Any]]


@dataclass
class Future:
    """One request's outcome: a JSON-able dict or protobuf bytes (`proto`), or an error with its category."""

    request_id: str
    created: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Any = None
    proto: bool = False
    error: str | None = None
    category: str = "unknown"
    finished_at: float | None = None
    retrieved_at: float | None = None

    def finish(self, result: Any, proto: bool = False) -> None:
        self.result, self.proto, self.finished_at = result, proto, time.monotonic()
        self.done.set()

    def fail(self, message: str, category: str) -> None:
        self.error, self.category, self.finished_at = message, category, time.monotonic()
        self.done.set()


def describe(exc: BaseException) -> tuple[str, str]:
    """(message, Tinker error category) of a failed job: 4xx are the user's, anything else the server's."""
    if isinstance(exc, ApiError):
        where = f" ({exc.param})" if exc.param else ""
        return f"{exc.message}{where}", "user" if exc.status < 500 else "server"
    return f"internal error ({type(exc).__name__}); see the server log", "server"


class FutureStore:
    """Bounded table of futures by request id (see the module docstring for the policy)."""

    def __init__(self, max_futures: int, result_ttl_s: float, retrieved_grace_s: float) -> None:
        self.max_futures, self.result_ttl_s, self.retrieved_grace_s = max_futures, result_ttl_s, retrieved_grace_s
        self._futures: OrderedDict[str, Future] = OrderedDict()

    def __len__(self) -> int:
        return len(self._futures)

    def sweep(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for rid, fut in list(self._futures.items()):
            if fut.retrieved_at is not None and now - fut.retrieved_at > self.retrieved_grace_s:
                del self._futures[rid]
            elif fut.finished_at is not None and now - fut.finished_at > self.result_ttl_s:
                log.info("tinker future %s expired unretrieved", rid)
                del self._futures[rid]

    def new(self) -> Future:
        """A fresh pending future (429 when the table is full of pending ones)."""
        self.sweep()
        while len(self._futures) >= self.max_futures:
            oldest = next((rid for rid, f in self._futures.items() if f.finished_at is not None), None)
            if oldest is None:
                raise ApiError(429, f"{len(self._futures)} requests are pending (app.tinker.max_futures); retry later")
            del self._futures[oldest]
        fut = Future(request_id=uuid.uuid4().hex)
        self._futures[fut.request_id] = fut
        return fut

    def get(self, request_id: str) -> Future | None:
        return self._futures.get(request_id)

    async def run(self, fut: Future, job: Job, proto: bool = False) -> None:
        """Run `job` and record its result or its error (never raises: the error is the future's)."""
        try:
            fut.finish(await job(), proto)
        except asyncio.CancelledError:
            fut.fail("the server shut down before this request ran", "server")
            raise
        except Exception as exc:
            if not isinstance(exc, ApiError) or exc.status >= 500:
                log.exception("tinker request %s failed", fut.request_id)
            fut.fail(*describe(exc))

    def start(self, job: Job, proto: bool = False) -> Future:
        """A future for `job`, run at once (requests without ordering: create_model, samples)."""
        fut = self.new()
        task = asyncio.get_running_loop().create_task(self.run(fut, job, proto))
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
        return fut


_tasks: set[asyncio.Task] = set()  # strong references to running jobs (the loop keeps only weak ones)


class ModelQueue:
    """One training model's requests, run in `seq_id` order on a worker task.

    Args:
        store: where futures live.
        max_pending: queued requests at most (429 beyond).
        gap_timeout_s: how long a missing `seq_id` may hold later requests; then they fail and the queue moves on.
        next_seq: the first `seq_id` expected (the SDK numbers a model's requests from 1).
    """

    def __init__(self, store: FutureStore, max_pending: int, gap_timeout_s: float, next_seq: int = 1) -> None:
        self.store, self.max_pending, self.gap_timeout_s = store, max_pending, gap_timeout_s
        self.next_seq = next_seq
        self.pending: dict[int, tuple[Future, Job, bool]] = {}
        self.seen: OrderedDict[int, str] = OrderedDict()  # seq_id → request id (resent requests), bounded
        self.skipped: set[int] = set()  # seq_ids refused at submission
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    def submit(self, seq_id: int, job: Job, proto: bool = False) -> str:
        """Queue `job` as `seq_id`; returns its request id (the existing one for a resent `seq_id`)."""
        if seq_id in self.seen:
            return self.seen[seq_id]
        if seq_id < self.next_seq:
            raise ApiError(400, f"seq_id {seq_id} was already run (the model expects {self.next_seq} next)", "seq_id")
        if len(self.skipped) > 4 * self.max_pending:  # a client refusing everything: keep the set bounded
            self.skipped = set(sorted(self.skipped)[-self.max_pending :])
        if len(self.pending) >= self.max_pending:
            queued = len(self.pending)
            raise ApiError(429, f"{queued} requests are queued for this model (app.tinker.max_pending_per_model)")
        fut = self.store.new()
        self.pending[seq_id] = (fut, job, proto)
        self.seen[seq_id] = fut.request_id
        while len(self.seen) > 4 * self.max_pending:
            self.seen.popitem(last=False)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._work())
        return fut.request_id

    def skip(self, seq_id: int) -> None:
        """`seq_id` was refused when submitted (a 4xx): the client counted it, so later requests must not wait."""
        if seq_id >= self.next_seq and seq_id not in self.pending:
            self.skipped.add(seq_id)
            self._wakeup.set()
            if self.pending and (self._task is None or self._task.done()):
                self._task = asyncio.get_running_loop().create_task(self._work())

    async def _work(self) -> None:
        while self.pending:
            if self.next_seq in self.skipped:
                self.skipped.discard(self.next_seq)
                self.next_seq += 1
                continue
            if self.next_seq in self.pending:
                fut, job, proto = self.pending.pop(self.next_seq)
                self.next_seq += 1
                await self.store.run(fut, job, proto)
                continue
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), self.gap_timeout_s)
            except asyncio.TimeoutError:
                self._fail_gap()

    def _fail_gap(self) -> None:
        missing, last = self.next_seq, max(self.pending)
        message = f"seq_id {missing} never arrived within {self.gap_timeout_s:g} s, so later requests were not run"
        for fut, _, _ in self.pending.values():
            fut.fail(message, "user")
        self.pending.clear()
        self.next_seq = last + 1
        self.skipped = {x for x in self.skipped if x > last}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for fut, _, _ in self.pending.values():
            fut.fail("the training model was removed before this request ran", "user")
        self.pending.clear()
