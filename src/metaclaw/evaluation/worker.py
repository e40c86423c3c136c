"""`EvalWorker`: the bounded queue of adapters waiting to be evaluated and the one thread that works through it.

The queue holds at most `max_pending` items per agent and drops the oldest waiting one when a newer arrives (a
report-only pass of the judge fallback goes first): training and serving never wait for it. `close` stops
recording: what is running or queued then goes to `unfinished`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from metaclaw.evaluation.gate import HotLoad

log = logging.getLogger("metaclaw.evaluation.live")

TURNS, FINAL_TURNS = -1, -2  # queue markers of the judge fallback: report replaced versions / all versions
Item = tuple[str, int, Path | None, HotLoad | None]  # (agent, step, candidate path, hot-load when gated)


class EvalWorker:
    """One thread, one bounded queue: `handle(item)` for each item, `idle()` after each quiet spell.

    Args:
        max_pending: per-agent queue bound (the oldest waiting item is dropped first).
        handle: evaluates one item (on the worker's thread).
        idle: runs when no item arrived within `idle_s()` seconds (None: wait for an item).
        idle_s: how long a quiet spell lasts, asked each time.
        on_drop: told of each candidate dropped for a newer one (under the queue's lock).
    """

    def __init__(
        self,
        max_pending: int,
        handle: Callable[[Item], None],
        idle: Callable[[], None],
        idle_s: Callable[[], float | None],
        on_drop: Callable[[Item], None],
    ) -> None:
        if max_pending < 1:
            raise ValueError("eval.max_pending must be >= 1")
        self.max_pending = max_pending
        self._handle, self._idle, self._idle_s, self._on_drop = handle, idle, idle_s, on_drop
        self.cond = threading.Condition()  # guards the queue and what is recorded (`LiveEvaluator`'s reports)
        self._items: deque[Item] = deque()
        self._current: Item | None = None  # the item being evaluated (its candidate is kept on disk meanwhile)
        self._stop = False
        self.closed = False  # nothing is recorded after the end of training stopped waiting
        self.unfinished: list[dict[str, Any]] = []  # evaluations the end of training did not wait for
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="live-evaluator", daemon=True)
            self.thread.start()

    def put(self, item: Item) -> bool:
        """Queue `item` (dropping its agent's oldest waiting one beyond `max_pending`); False: not queued (a
        report-only pass when one of the agent's items is waiting already: that one reports too)."""
        agent, step = item[0], item[1]
        with self.cond:
            waiting = [it for it in self._items if it[0] == agent]
            if step == TURNS and waiting:
                return False
            while len(waiting) >= self.max_pending:
                # a report-only pass goes first (the newcomer reports too): it never pushes a candidate out
                dropped = next((it for it in waiting if it[1] == TURNS), waiting[0])
                waiting.remove(dropped)
                self._items.remove(dropped)
                if dropped[1] != TURNS:
                    self._on_drop(dropped)
            self._items.append(item)
            self.cond.notify_all()
        return True

    def paths(self) -> set[Path]:
        """The candidates waiting or being measured."""
        with self.cond:
            items = [*self._items, *([self._current] if self._current else [])]
            return {item[2] for item in items if item[2] is not None}

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._items and not self._stop:
                    if not self.cond.wait(self._idle_s()):
                        break  # a quiet spell
                if self._stop and not self._items:
                    return
                item = self._items.popleft() if self._items else None
                self._current = item
            if item is None:
                self._idle()
                continue
            try:
                self._handle(item)
            finally:
                with self.cond:
                    self._current = None
                    self.cond.notify_all()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the queue is drained (True) or `timeout_s` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            while self._items or self._current:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    log.warning("Eval: %d evaluations still running and %d queued after %.0fs",
                                int(self._current is not None), len(self._items), timeout_s)  # fmt: skip
                    return False
                self.cond.wait(left)
        return True

    def close(self) -> list[dict[str, Any]]:
        """Record nothing from now on: the running and queued items go to `unfinished` (once)."""
        with self.cond:
            if not self.closed:
                self.closed = True
                pending = ([self._current] if self._current else []) + list(self._items)
                self.unfinished = [{"agent_id": a, "step": s if s >= 0 else None} for a, s, *_ in pending]
                self._items.clear()
                self.cond.notify_all()
            return self.unfinished

    def stop(self, timeout: float = 10.0) -> None:
        self.close()
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self.thread:
            self.thread.join(timeout)
