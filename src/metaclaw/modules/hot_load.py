"""`HotLoader`: asks the policy server to load each published adapter, and keeps the version it confirmed.

A failed load leaves the server on the adapter it still serves (so samples it keeps producing are not stale);
`max_failures` failures in a row are fatal (`HotLoadError`, raised by the publisher on every rank). While the
server is down or restarting (`restarting()`), a failed load is not counted: the watchdog restarts the server and
reloads the newest adapter, or stops the run naming what died.

`asynchronous`: the load runs on a thread of its own and `serve` returns at once, so the training step never
waits for the server (whose model lock a generation may hold for seconds). Loads stay in order: the next `serve`
(or `settle`) first waits for the previous one, which had a whole step to finish; its outcome (the version now
served, a failure) is known from then on, one publish later than with synchronous loads.
`serve` may be called from the gate's thread while the step's thread settles: a lock keeps the loads one at a
time, and the load under way is only ever a started thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from metaclaw.wire.client import CallError, Endpoint, load_adapter

log = logging.getLogger(__name__)


class HotLoadError(RuntimeError):
    """The policy server refused or missed every hot-load for too long: nothing new is being served."""


class HotLoader:
    """Hot-loads adapters into the policy server at `server_url`; without one, "served" means published.

    Args:
        server_url: policy server base URL (`http://127.0.0.1:8000`); None: no server.
        lora_name: the name the adapter is served under (the OpenAI `model` field).
        api_key: bearer key for the server.
        timeout_s: how long a load request may take.
        max_failures: failures in a row that are fatal (None: only warn).
        asynchronous: load on a background thread; `serve` does not wait (see the module docstring).
    """

    def __init__(
        self,
        server_url: str | None = None,
        lora_name: str = "policy",
        api_key: str | None = None,
        timeout_s: float = 30.0,
        max_failures: int | None = 3,
        asynchronous: bool = False,
    ) -> None:
        if max_failures is not None and max_failures < 1:
            raise ValueError(f"publish.max_hot_load_failures must be >= 1 or null, got {max_failures}")
        self.server_url, self.lora_name, self.api_key, self.timeout_s = server_url, lora_name, api_key, timeout_s
        self.max_failures = max_failures
        self.served_version = 0  # the adapter version the policy server confirmed (published, without a server)
        self.stats = {"hot_load_failures": 0, "hot_load_failures_in_a_row": 0}
        self.restarting: Callable[[], bool] = lambda: False
        self._last_error = ""
        self.asynchronous = asynchronous
        self._inflight: threading.Thread | None = None  # only ever a started thread (settle may run anywhere)
        self._order = threading.Lock()  # serve() from the gate's thread and the step's: one load at a time

    def connect(self, server: Endpoint, restarting: Callable[[], bool] | None = None) -> None:
        """Point at the live loop's policy server (its address and key, resolved once by the loop)."""
        self.server_url, self.api_key = server.url, server.api_key
        if restarting is not None:
            self.restarting = restarting

    def serve(self, path: Path, step: int) -> int:
        """Serve `path` (hot-load it when there is a server); returns the version now served (asynchronous: the
        version served so far; `path`'s load is under way)."""
        if not self.server_url:
            self.served_version = step
        elif not self.asynchronous:
            self.served_version = self._load(path, step)
        else:
            with self._order:
                self.settle()
                inflight = threading.Thread(target=self._load_in_background, args=(path, step), name="hot-load",
                                            daemon=True)  # fmt: skip
                inflight.start()
                self._inflight = inflight  # published once started: a concurrent settle() can join it
        return self.served_version

    def _load_in_background(self, path: Path, step: int) -> None:
        self.served_version = self._load(path, step)

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the load under way (asynchronous), at most `timeout_s` (default: the load's own timeout)."""
        inflight = self._inflight
        if inflight is not None:
            inflight.join(self.timeout_s + 5.0 if timeout_s is None else timeout_s)
            if not inflight.is_alive() and self._inflight is inflight:
                self._inflight = None

    def fatal(self) -> str | None:
        """Why the run must stop, once `max_failures` loads failed in a row; else None."""
        limit = self.max_failures
        if limit is None or self.stats["hot_load_failures_in_a_row"] < limit:
            return None
        return (
            f"The policy server at {self.server_url} failed to load {limit} adapters in a row "
            f"(last: {self._last_error}); it still serves v{self.served_version}, so training "
            "would go on without its updates reaching the agent. Check the server (server/server.log) or "
            "raise publish.max_hot_load_failures."
        )

    def _load(self, path: Path, step: int) -> int:
        """Ask the server to load `path`; returns the version it now serves (unchanged when the load failed)."""
        try:
            reply = load_adapter(Endpoint(self.server_url, self.api_key), self.lora_name, str(path.resolve()),
                                 self.timeout_s, version=step)  # fmt: skip
            version = reply.get("adapter_version", step)
        except (CallError, ValueError) as e:  # serving keeps the previous adapter; training goes on
            if self.restarting():  # dead or restarting: the watchdog restarts it (and reloads the newest
                # adapter) or stops the run naming what died; these are not hot-load failures
                log.warning("Policy server is down: %s will be loaded if it comes back (%s)", path.name, e)
                return self.served_version
            self.stats["hot_load_failures"] += 1
            self.stats["hot_load_failures_in_a_row"] += 1
            self._last_error = f"{path.name}: {e}"[:300]
            log.warning(
                "Policy server did not load %s (%d in a row): %s", path, self.stats["hot_load_failures_in_a_row"], e
            )
            return self.served_version
        self.stats["hot_load_failures_in_a_row"] = 0
        return int(version) if isinstance(version, int) else step
