"""Plug points for skills: the proxy injects skills on main turns, the scorer hands failed turns to an evolver.

`metaclaw.skills.SkillInjector` and `SkillEvolver` satisfy these Protocols; anything else with the same
methods does too (tests use a trivial injector). The live loop wraps the injector in `FailSafeInjector` (a skills
problem never fails an agent's request) and the scoring worker drives the evolver through `EvolutionScheduler`
(off the request path and off the scoring loop, one evolution at a time).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

log = logging.getLogger(__name__)

MAX_QUEUED_TURNS = 32  # failed turns kept per agent between evolutions (the evolver sends its own most recent few)
PAUSE_AFTER = 3  # consecutive unusable evolutions of an agent before its evolution backs off
MAX_SKIPPED_TRIGGERS = 32  # the longest back-off, in triggers (session ends and every-N-turns points)
MAX_AGENTS = 256  # agents whose queues and counters are kept; the least recently active one is dropped beyond it
MAX_PENDING_EVOLUTIONS = 8  # evolutions waiting for the evolver thread; a trigger beyond it keeps its turns queued


class SkillInjectorLike(Protocol):
    """Adds relevant skills to a request's messages."""

    def inject(
        self, messages: Sequence[Mapping[str, Any]], agent_id: str
    ) -> tuple[list[dict[str, Any]], list[str]]: ...

    def generation(self, agent_id: str) -> int: ...


class SkillEvolverLike(Protocol):
    """Proposes skill changes from turns that scored ≤ 0."""

    def evolve(self, agent_id: str, failed_turns: Sequence[Mapping[str, Any]]) -> Any: ...


class FailSafeInjector:
    """An injector whose failures (unreadable skills root, an `X-Agent-Id` that is no valid folder name, ...)
    are logged once per agent and cost only the skills: the turn goes upstream unchanged with `names == []`.

    Malformed `SKILL.md` files never get here: the library skips them with a warning naming the file.
    """

    def __init__(self, injector: SkillInjectorLike) -> None:
        self.injector = injector
        self._warned: set[tuple[str, str]] = set()

    def inject(self, messages: Sequence[Mapping[str, Any]], agent_id: str) -> tuple[list[dict[str, Any]], list[str]]:
        try:
            return self.injector.inject(messages, agent_id)
        except Exception as e:  # noqa: BLE001 - skills are an extra; the agent's request must go through
            self._warn(agent_id, "inject", e)
            return [dict(m) for m in messages], []

    def generation(self, agent_id: str) -> int:
        try:
            return self.injector.generation(agent_id)
        except Exception as e:  # noqa: BLE001 - as above
            self._warn(agent_id, "generation", e)
            return 0

    def _warn(self, agent_id: str, what: str, e: Exception) -> None:
        key = (agent_id, f"{what}:{type(e).__name__}")
        if key not in self._warned and len(self._warned) < 1024:
            self._warned.add(key)
            log.warning("Skills %s for agent %r failed, forwarding without skills: %r", what, agent_id, e)


class EvolutionScheduler:
    """Decides when an agent's failed turns go to the evolver, and runs it on a thread of its own.

    The scoring worker calls `note` for every scored main turn and `session_finished` when a session ends
    (`X-Session-Done` or idle). An agent's queued turns with judge reward ≤ 0 are handed over when one of its
    sessions finishes and after every `every_n_turns` scored main turns of that agent. Evolutions run one at a
    time (so changes to a library never race); a failing evolver is logged and never raises here.

    Back-off: after `PAUSE_AFTER` unusable evolutions in a row of one agent (the request failed, or the reply was
    no valid JSON: a model too small to write it), that agent's next 2, 4, 8, ... (at most
    `MAX_SKIPPED_TRIGGERS`) triggers are skipped, with a warning naming the last error, so an evolver that cannot
    do its job does not keep taking the policy server's time from the user and the trainer. Its failed turns
    stay queued (bounded) for the next try; one usable evolution ends the back-off.

    Bounded per agent (`X-Agent-Id` is the client's to choose): queues and counters are kept for the
    `MAX_AGENTS` most recently active agents (the least recently active agent's queued turns are dropped, logged
    and counted as `dropped_agents`); at most one evolution per agent and `MAX_PENDING_EVOLUTIONS` in all wait for
    the evolver thread (a trigger beyond that keeps its turns queued for the next one, counted as `deferred`).

    Args:
        evolver: what proposes and writes skill changes (`metaclaw.skills.SkillEvolver`).
        every_n_turns: also evolve after this many scored main turns of an agent; None or 0: only at session end.
    """

    def __init__(self, evolver: SkillEvolverLike, every_n_turns: int | None = None) -> None:
        if every_n_turns is not None and every_n_turns < 0:
            raise ValueError(f"skills.evolve_every_n_turns must be >= 0 or null (got {every_n_turns})")
        self.evolver, self.every_n_turns = evolver, every_n_turns or None
        self._failed: dict[str, dict[int, dict[str, Any]]] = {}
        self._turns: OrderedDict[str, int] = OrderedDict()  # every tracked agent, least recently active first
        self._queued: dict[str, Future] = {}  # agent -> its evolution waiting or running
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._unusable: dict[str, int] = {}  # agent -> unusable evolutions in a row
        self._skip: dict[str, int] = {}  # agent -> triggers still to skip
        self.stats = {"evolutions": 0, "accepted": 0, "rejected": 0, "errors": 0, "unusable": 0, "skipped": 0,
                      "quarantined": 0, "dropped_agents": 0, "deferred": 0}  # fmt: skip

    def note(
        self,
        agent_id: str,
        sample_id: int,
        reward: float | None,
        messages: Any = None,
        response: str | None = None,
        next_state: str | None = None,
    ) -> None:
        """Count one scored main turn; queue it when the judge's reward is ≤ 0 (None: judging failed, not queued)."""
        with self._lock:
            if reward is not None and reward <= 0:
                queue = self._failed.setdefault(agent_id, {})
                queue[sample_id] = {
                    "sample_id": sample_id,
                    "messages": messages or [],
                    "response": response or "",
                    "reward": reward,
                    "next_state": next_state,
                }
                while len(queue) > MAX_QUEUED_TURNS:
                    queue.pop(next(iter(queue)))
            self._turns[agent_id] = self._turns.get(agent_id, 0) + 1
            self._turns.move_to_end(agent_id)
            due = self.every_n_turns is not None and self._turns[agent_id] >= self.every_n_turns
            self._forget_idlest()
        if due:
            self._trigger(agent_id, f"{self.every_n_turns} main turns")

    def _forget_idlest(self) -> None:
        """Drop the least recently active agents beyond `MAX_AGENTS` (lock held)."""
        while len(self._turns) > MAX_AGENTS:
            agent, _ = self._turns.popitem(last=False)
            dropped = len(self._failed.pop(agent, {}))
            self._unusable.pop(agent, None)
            self._skip.pop(agent, None)
            self.stats["dropped_agents"] += 1
            log.warning("Skill evolution tracks at most %d agents: dropped the least recently active one, %s "
                        "(%d queued failed turns)", MAX_AGENTS, agent, dropped)  # fmt: skip

    def session_finished(self, agent_id: str, session_id: str) -> None:
        """A session of `agent_id` ended: evolve from the agent's queued failed turns, if any."""
        self._trigger(agent_id, f"session {session_id} ended")

    def _trigger(self, agent_id: str, why: str) -> None:
        with self._lock:
            if agent_id in self._turns:
                self._turns[agent_id] = 0
            if not self._failed.get(agent_id):
                return
            self._futures = [f for f in self._futures if not f.done()]
            running = self._queued.get(agent_id)
            if (running is not None and not running.done()) or len(self._futures) >= MAX_PENDING_EVOLUTIONS:
                self.stats["deferred"] += 1  # its turns stay queued (bounded) for the next trigger
                return
            if self._skip.get(agent_id):
                self._skip[agent_id] -= 1
                self.stats["skipped"] += 1
                return
            queued = self._failed.pop(agent_id)
            turns = [queued[k] for k in sorted(queued)]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skill-evolver")
            future = self._queued[agent_id] = self._pool.submit(self._run, agent_id, turns, why)
            self._futures.append(future)
            self._queued = {a: f for a, f in self._queued.items() if not f.done() or a == agent_id}

    def _run(self, agent_id: str, turns: list[dict[str, Any]], why: str) -> None:
        ids = [t["sample_id"] for t in turns]
        log.info("Evolving skills of agent %s (%s) from %d failed turns %s", agent_id, why, len(turns), ids)
        try:
            result = self.evolver.evolve(agent_id, turns)
        except Exception as e:  # noqa: BLE001 - evolution is best effort; scoring and serving go on
            self.stats["errors"] += 1
            log.warning("Skill evolution for agent %s failed: %r", agent_id, e)
            self._unusable_result(agent_id, repr(e))
            return
        self.stats["evolutions"] += 1
        accepted = list(getattr(result, "accepted_names", []) or [])
        rejected = len(getattr(result, "rejected", []) or [])
        self.stats["accepted"] += len(accepted)
        self.stats["rejected"] += rejected
        self.stats["quarantined"] += len(getattr(result, "quarantined", []) or [])
        error = getattr(result, "error", None)
        if error:
            log.warning("Skill evolution for agent %s got no usable proposal: %s", agent_id, error)
            self._unusable_result(agent_id, error)
        else:
            with self._lock:
                self._unusable.pop(agent_id, None)
            log.info(
                "Skill evolution for agent %s: accepted %s, rejected %d, generation %s",
                agent_id,
                accepted or "nothing",
                rejected,
                getattr(result, "generation", "?"),
            )

    def _unusable_result(self, agent_id: str, error: str) -> None:
        """Count an evolution that gave nothing usable; from the `PAUSE_AFTER`-th in a row, back off."""
        with self._lock:
            self.stats["unusable"] += 1
            n = self._unusable[agent_id] = self._unusable.get(agent_id, 0) + 1
            if n < PAUSE_AFTER:
                return
            skip = self._skip[agent_id] = min(MAX_SKIPPED_TRIGGERS, 2 ** (n - PAUSE_AFTER + 1))
        log.warning(
            "Skill evolution for agent %s backs off: %d evolutions in a row gave nothing usable (last: %s); its next "
            "%d triggers are skipped. Is skills.evolver a model that can write the evolver's JSON? (skills.evolver."
            "base_url points it at another OpenAI-compatible endpoint)",
            agent_id,
            n,
            error[:200],
            skip,
        )

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for the evolutions submitted so far; True when all finished within `timeout_s`."""
        with self._lock:
            futures = list(self._futures)
        return not wait(futures, timeout=timeout_s).not_done

    def close(self, timeout_s: float | None = None) -> None:
        """Let the running evolution finish (up to `timeout_s`), drop queued ones, stop the thread."""
        self.drain(timeout_s)
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
