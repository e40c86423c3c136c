"""`SimulatedUser`: a person with hidden preferences, talking to the agent through the rollout proxy.

Each worker thread runs sessions of `turns_per_session` tasks (train split only). After every reply the user
checks its preferences and answers like a person in its next message: thanks when the reply complies, a
correction naming what was wrong and the rule otherwise, then the next question after a blank line:

    That's not what I wanted. Your reply started with 'The capital'. Always start your reply with 'Sure:'.

    Next question: How tall is Mount Everest?

The first sentence carries the verdict (the rule judge's patterns), the rest of the first paragraph is the
correction (the rule judge's OPD hint). The session's last message is the feedback alone with
`X-Session-Done`; the agent's reply to it is capped at one token. A share of sessions (`anthropic_share`) goes
through the Anthropic route `/v1/messages`, the rest through the real `openai` client. The sessions run on the
one simulated-people driver (`metaclaw.simulate.driver.Driver`), as the real path's `People` do.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from metaclaw import profiling
from metaclaw.simulate.driver import Driver
from metaclaw.simulate.preferences import PreferenceSet, Violation
from metaclaw.simulate.tasks import Task, load_tasks
from metaclaw.thinking import Thinking, read_answer
from metaclaw.wire.client import Endpoint, openai_client

log = logging.getLogger(__name__)

THANKS = "Thanks, that's what I wanted."
CORRECTION = "That's not what I wanted."


def feedback(violations: list[Violation], next_task: str | None = None) -> str:
    """The user's next message: thanks, or a correction saying what was wrong; then the next question."""
    if not violations:
        text = THANKS
    else:
        parts = [f"{v.problem.rstrip('.')}. {v.instruction}" for v in violations]
        text = f"{CORRECTION} {' '.join(parts)}"
    return f"{text}\n\nNext question: {next_task}" if next_task else text


class UserClient:
    """How the simulated user sends a conversation: the `openai` client, or `/v1/messages` (the Anthropic route).

    Args: as `SimulatedUser`'s (`model`, `temperature`, `thinking`, `api_key`, `timeout_s`)."""

    def __init__(
        self,
        base_url: str,
        model: str = "metaclaw",
        temperature: float = 1.0,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        thinking: Thinking | Mapping[str, Any] | None = None,
    ) -> None:
        self.endpoint = Endpoint(base_url, api_key)  # with or without /v1
        self.base_url, self.api_key = self.endpoint.v1, api_key
        self.client = openai_client(self.endpoint, timeout_s, max_retries=1)
        self.http = httpx.Client(timeout=timeout_s)
        self.model, self.temperature, self.thinking = model, temperature, Thinking.of(thinking)

    # ---- one request ----------------------------------------------------------------------------------------
    def ask(self, messages: list[dict[str, str]], headers: dict[str, str], anthropic: bool, max_tokens: int) -> str:
        """Send the conversation; the assistant's answer (its reasoning, if any, left out)."""
        fields = self.thinking.fields(max_tokens)
        if not anthropic:
            out = self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                max_tokens=fields.pop("max_tokens"),
                temperature=self.temperature,
                extra_headers=headers,
                extra_body=fields or None,
            )
            choice = out.choices[0]
            return read_answer(choice.message.model_dump(), choice.finish_reason, "simulated user", max_tokens)
        body: dict[str, Any] = {
            "model": self.model,
            "temperature": self.temperature,
            "messages": [m for m in messages if m["role"] != "system"],
            **fields,
        }
        if messages and messages[0]["role"] == "system":
            body["system"] = messages[0]["content"]
        hdrs = {**headers, "anthropic-version": "2023-06-01"}
        if self.api_key:
            hdrs["x-api-key"] = self.api_key
        r = self.http.post(f"{self.base_url}/messages", json=body, headers=hdrs)
        r.raise_for_status()
        data = r.json()
        text = "".join(b.get("text", "") for b in data.get("content", []) if b.get("type") == "text")
        finish = "length" if data.get("stop_reason") == "max_tokens" else data.get("stop_reason")
        return read_answer({"content": text}, finish, "simulated user (Anthropic route)", max_tokens)

    def close(self) -> None:
        self.http.close()


class SimulatedUser:
    """Drives the proxy at `base_url` (`.../v1`) from `concurrency` threads until `stop()` or `max_sessions`.

    Args:
        base_url: the proxy's OpenAI base URL (`http://127.0.0.1:PORT/v1`).
        preferences: the hidden rules, `[{kind, ...params}]` (see `metaclaw.simulate.preferences`).
        tasks_file: JSONL of tasks; None: the packaged ones.
        split: which tasks are asked (`train`); the evaluator asks the held-out ones.
        concurrency: sessions in flight at once.
        turns_per_session: tasks per session (each answered, then judged in the user's next message).
        anthropic_share: fraction of sessions sent through `/v1/messages`.
        model: the `model` field sent (the proxy maps it to the policy).
        max_tokens: per reply.
        temperature: sampling temperature sent.
        system: optional system prompt of every session.
        api_key: the proxy's key, if any.
        timeout_s: per request.
        max_sessions: stop after this many sessions (None: until stopped).
        seed: task order.
        agent_id: `X-Agent-Id` sent.
        window: replies in the rolling compliance figure (`stats['recent_compliance']`).
        max_ahead: no new session starts while this many captured turns wait to be trained (`backlog()`, set by
            the live loop to the store's): on a CPU the user then leaves the cores to training and the samples
            stay on-policy, instead of piling up; None: never waits.
        thinking: `model.thinking` (`metaclaw.thinking.Thinking`): `chat_template_kwargs` sent on both routes,
            budget added to `max_tokens`; the verifier reads the answer, never the reasoning.
    """

    def __init__(
        self,
        base_url: str,
        preferences: list[Mapping[str, Any]] | PreferenceSet,
        tasks_file: str | None = None,
        split: str = "train",
        concurrency: int = 2,
        turns_per_session: int = 3,
        anthropic_share: float = 0.25,
        model: str = "metaclaw",
        max_tokens: int = 32,
        temperature: float = 1.0,
        system: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_sessions: int | None = None,
        seed: int = 0,
        agent_id: str = "simulated-user",
        window: int = 50,
        max_ahead: int | None = None,
        thinking: Thinking | Mapping[str, Any] | None = None,
    ) -> None:
        if concurrency < 1 or turns_per_session < 1:
            raise ValueError("simulated user: concurrency and turns_per_session must be >= 1")
        if not 0.0 <= anthropic_share <= 1.0:
            raise ValueError(f"simulated user: anthropic_share must be in [0, 1], got {anthropic_share}")
        self.prefs = preferences if isinstance(preferences, PreferenceSet) else PreferenceSet(preferences)
        self.tasks: list[Task] = load_tasks(tasks_file, split)
        self.client = UserClient(base_url, model, temperature, api_key, timeout_s, thinking)
        self.turns_per_session, self.anthropic_share = turns_per_session, anthropic_share
        self.max_tokens, self.system, self.agent_id = max_tokens, system, agent_id
        self._lock = threading.Lock()
        self._recent: deque[bool] = deque(maxlen=window)
        self._stats: dict[str, Any] = {"sessions": 0, "anthropic_sessions": 0, "replies": 0, "complied": 0,
                                       "corrected": 0}  # fmt: skip
        self.driver = Driver("simulated-user", concurrency, self._converse, seed, max_sessions, max_ahead=max_ahead)

    @property
    def stats(self) -> dict[str, Any]:
        """Sessions, replies, how many complied or were corrected, failures, seconds waited for training, and the
        rolling compliance of the last `window` replies."""
        figures = self.driver.figures()
        with self._lock:
            return {**self._stats, "errors": figures["errors"], "waited_s": figures["waited_s"]}

    @property
    def backlog(self) -> Callable[[], int] | None:
        """Captured turns not yet trained (the live loop's store; `max_ahead` waits on it)."""
        return self.driver.backlog

    @backlog.setter
    def backlog(self, fn: Callable[[], int] | None) -> None:
        self.driver.backlog = fn

    def ask(self, messages: list[dict[str, str]], headers: dict[str, str], anthropic: bool, max_tokens: int) -> str:
        """Send the conversation; the assistant's answer (its reasoning, if any, left out)."""
        return self.client.ask(messages, headers, anthropic, max_tokens)

    # ---- one session ----------------------------------------------------------------------------------------
    def session(self, rng: random.Random, index: int) -> None:
        """One multi-turn session: tasks, each reply judged in the next user message."""
        with profiling.phase("user_simulation", cpu="thread"):
            self._session(rng, index)

    def _session(self, rng: random.Random, index: int) -> None:
        anthropic = rng.random() < self.anthropic_share
        sid = f"sim-{index}-{uuid.uuid4().hex[:8]}"
        base = {"X-Session-Id": sid, "X-Turn-Type": "main", "X-Agent-Id": self.agent_id}
        tasks = rng.sample(self.tasks, min(self.turns_per_session, len(self.tasks)))
        messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": tasks[0].prompt})
        for t in range(len(tasks)):
            if self.driver.stopping.is_set():
                return
            reply = self.ask(messages, base, anthropic, self.max_tokens)
            violations = self.prefs.check(reply)
            self._record(not violations)
            nxt = tasks[t + 1].prompt if t + 1 < len(tasks) else None
            messages.append({"role": "assistant", "content": reply})
            messages.append({"role": "user", "content": feedback(violations, nxt)})
        # The last feedback ends the session; the agent's acknowledgement is not worth more than one token.
        self.ask(messages, {**base, "X-Session-Done": "true"}, anthropic, 1)
        with self._lock:
            self._stats["sessions"] += 1
            self._stats["anthropic_sessions"] += anthropic

    def _record(self, ok: bool) -> None:
        with self._lock:
            self._stats["replies"] += 1
            self._stats["complied" if ok else "corrected"] += 1
            self._recent.append(ok)
            self._stats["recent_compliance"] = sum(self._recent) / len(self._recent)

    def _converse(self, worker: int, rng: random.Random, index: int) -> None:
        self.session(rng, index)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> SimulatedUser:
        log.info(
            "Simulated user: %d sessions at once, %d tasks each; hidden preference: %s",
            self.driver.workers,
            self.turns_per_session,
            self.prefs.describe(),
        )
        self.driver.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self.driver.join(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self.driver.stop(timeout)
        self.client.close()
