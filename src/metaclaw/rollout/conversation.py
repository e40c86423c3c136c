"""Conversation fingerprints: which open session a request without session ids continues.

A chat client resends the whole conversation on every turn, so a request continues a session when its
messages extend what that session's last turn sent plus the reply it got. Each captured turn leaves a *tail*:
three fingerprints of the conversation as it stands after the reply. A new request is matched against them,
strongest first:

1. `full`: every non-system message up to the request's last assistant message equals the session's last
   request plus its reply (the ordinary case; two conversations that both opened with "hi" differ in the
   reply each got, so they stay apart).
2. `last`: the last exchange (the messages after the previous assistant message, plus the reply) is the same,
   the older history is not (the client trimmed or summarised its context).
3. `prompt`: everything before the last assistant message is the session's last request, the reply differs
   (the client edited or reformatted the reply it got).

System messages are left out of every fingerprint, so a system prompt that changes between turns (a clock,
injected memories or skills) does not split a session. Messages are compared in a canonical form: role, text
(stripped), tool calls by name and JSON-normalised arguments (ids left out, clients rewrite them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from metaclaw.messages import content_text

SEP, US = b"\x1e", "\x1f"  # record and unit separators


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw.strip()
    return raw


def canonical(message: dict[str, Any]) -> bytes:
    """The form two copies of one message share however the client re-serialised it."""
    out = f"{message.get('role')}{US}{content_text(message.get('content')).strip()}"
    calls = [
        [str((tc.get("function") or {}).get("name", "")), _arguments((tc.get("function") or {}).get("arguments"))]
        for tc in message.get("tool_calls") or ()
        if isinstance(tc, dict)
    ]
    if calls:
        out += US + json.dumps(calls, sort_keys=True, ensure_ascii=False)
    return out.encode()


def _hasher(agent_id: str) -> Any:
    return hashlib.blake2b(agent_id.encode(), digest_size=16)


@dataclass(frozen=True)
class Tail:
    """The fingerprints a turn leaves for the next request of its conversation."""

    full: str
    last: str
    prompt: str

    def fingerprints(self) -> tuple[tuple[str, str], ...]:
        return (("full", self.full), ("last", self.last), ("prompt", self.prompt))


class Query:
    """One request's conversation: what it may continue (`candidates`) and how to build its own tail.

    Built in one pass over the messages (each hashed once; prefixes are copies of the running hash).
    """

    __slots__ = ("agent_id", "last_assistant", "_candidates", "_all", "_new")

    def __init__(self, messages: list[dict[str, Any]], agent_id: str) -> None:
        kept = [m for m in messages if m.get("role") != "system"]
        roles = [m.get("role") for m in kept]
        k = max((i for i, r in enumerate(roles) if r == "assistant"), default=-1)
        prev = max((i for i in range(k) if roles[i] == "assistant"), default=-1)
        everything, exchange, new = _hasher(agent_id), _hasher(agent_id), _hasher(agent_id)
        prompt = full = ""
        for i, m in enumerate(kept):
            part = SEP + canonical(m)
            if i == k:
                prompt = everything.hexdigest()  # hexdigest leaves the running hash as it is
            everything.update(part)
            if i == k:
                full = everything.hexdigest()
            if prev < i <= k:
                exchange.update(part)
            elif i > k:
                new.update(part)
        self.agent_id, self.last_assistant, self._all, self._new = agent_id, k, everything, new
        self._candidates = () if k < 0 else (("full", full), ("last", exchange.hexdigest()), ("prompt", prompt))

    @classmethod
    def of(cls, messages: list[dict[str, Any]], agent_id: str) -> Query:
        return cls(messages, agent_id)

    def candidates(self) -> tuple[tuple[str, str], ...]:
        """`(kind, fingerprint)` to look up, strongest first; empty for a conversation's first turn."""
        return self._candidates

    def tail(self, reply: dict[str, Any]) -> Tail:
        """The tail this request leaves once `reply` (the assistant message it got) is known."""
        part = SEP + canonical(reply)
        full, last = self._all.copy(), self._new.copy()
        full.update(part)
        last.update(part)
        return Tail(full=full.hexdigest(), last=last.hexdigest(), prompt=self._all.hexdigest())
