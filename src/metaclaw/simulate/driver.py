"""`Driver`: the one simulated-people driver. Threads that hold conversations with the proxy until `stop()`.

Both simulated talkers run on it: the main job's `SimulatedUser` (session headers, the rule judge's words) and
the real path's `People` (no headers, their own words, human pace). What a conversation says is theirs
(`converse`); the driver owns the threads, the numbering and bound of conversations, the wait for training
(`max_ahead`), the pause between conversations, and the failures (counted, the first few kept, never fatal).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

KEPT_ERRORS = 10  # the first failures' texts kept for the summary (the rest are counted)


class Driver:
    """Runs `converse(worker, rng, index)` on `workers` threads until `stop()` or the bound of conversations.

    Args:
        name: the threads' name and the log's ("simulated-user", "person").
        workers: threads, each with its own `random.Random(seed * 1000 + worker)`.
        converse: one conversation; `index` numbers it (across workers, or per worker with `per_worker`).
        seed: the workers' random seeds.
        max_conversations: stop after this many (None: until `stop()`); per worker with `per_worker`.
        per_worker: number and bound conversations per worker rather than across them.
        pause: called between a worker's conversations (e.g. a person's pause); None: none.
        max_ahead: no new conversation starts while this many captured turns wait to be trained (`backlog`).
        retry_s: how long a worker waits after a failed conversation.
    """

    def __init__(
        self,
        name: str,
        workers: int,
        converse: Callable[[int, random.Random, int], None],
        seed: int = 0,
        max_conversations: int | None = None,
        per_worker: bool = False,
        pause: Callable[[int, random.Random], None] | None = None,
        max_ahead: int | None = None,
        retry_s: float = 1.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"{name}: need >= 1 worker, got {workers}")
        self.name, self.workers, self.converse, self.seed, self.pause = name, workers, converse, seed, pause
        self.max_conversations, self.per_worker, self.max_ahead, self.retry_s = (
            max_conversations, per_worker, max_ahead, retry_s)  # fmt: skip
        self.backlog: Callable[[], int] | None = None  # captured turns not yet trained (the live loop's store)
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.counts: dict[str, float] = {"started": 0, "errors": 0, "waited_s": 0.0}
        self.first_errors: list[str] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> Driver:
        for w in range(self.workers):
            th = threading.Thread(target=self._run, args=(w,), name=f"{self.name}-{w}", daemon=True)
            th.start()
            self._threads.append(th)
        return self

    def join(self, timeout: float | None = None) -> None:
        for th in self._threads:
            th.join(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """No new message after the ones in flight; waits up to `timeout` for them."""
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))

    def _next(self, done: int) -> int | None:
        """The next conversation's index (`done`: this worker's conversations so far); None: the bound is met."""
        with self.lock:
            count = done if self.per_worker else int(self.counts["started"])
            if self.max_conversations is not None and count >= self.max_conversations:
                return None
            self.counts["started"] += 1
            return count

    def _run(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        done = 0
        while not self.stopping.is_set():
            self._wait_for_training()
            index = self._next(done)
            if index is None:
                return
            try:
                self.converse(w, rng, index)
            except Exception as e:  # noqa: BLE001 - the talker keeps talking; the count is reported
                if self.stopping.is_set():
                    return
                self._failed(w, index, e)
                self.stopping.wait(self.retry_s)
            done += 1
            if self.pause is not None:
                self.pause(w, rng)

    def _failed(self, w: int, index: int, e: Exception) -> None:
        with self.lock:
            self.counts["errors"] += 1
            if len(self.first_errors) < KEPT_ERRORS:
                self.first_errors.append(f"{self.name} {w}: {e!r}"[:300])
        log.warning("%s %d: conversation %d failed: %r", self.name, w, index, e)

    def _wait_for_training(self) -> None:
        """Hold the next conversation while `max_ahead` or more captured turns wait to be trained."""
        if self.max_ahead is None or self.backlog is None:
            return
        while not self.stopping.is_set() and self.backlog() >= self.max_ahead:
            self.stopping.wait(1.0)
            with self.lock:
                self.counts["waited_s"] += 1.0

    def figures(self) -> dict[str, float]:
        """What the driver counted: conversations started, failures, seconds waited for training."""
        with self.lock:
            return dict(self.counts)
