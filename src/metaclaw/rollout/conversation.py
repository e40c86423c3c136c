"""Conversation fingerprints: which open session a request without session ids continues.

A chat client resends the whole conversation on every turn, so a request continues a session when its
messages extend what that session's last turn sent plus the reply it got. Each captured turn leaves a *tail*:
three fingerprints of the conversation as it stands after the reply. A new request is matched against them,
strongest first:

1. `full`: every non-system message up to the request's last assistant message equals the session's last
   request plus its reply (the ordinary case; two conversations that both opened with "hi" differ in the
   reply each got, so they stay apart).
2. `last`: the last exchange (the messages after the previous assistant message, plus the reply) is the same,
   the older history is not (the client trimmed or summarised its context). `opening` is the same with only the
   exchange's first message and the reply: OpenClaw appends a message of runtime context to each request and
   leaves it out of the history it sends next, so its exchanges never compare whole.
3. `prompt`: everything before the last assistant message is the session's last request and the reply is a
   light edit of the recorded one (one contains the other, at least half its length, compared on letters and
   digits only): the client reformatted or annotated the reply it got. A reply that is not the recorded one
   never continues the session: whoever sends `[user "Hi", assistant <anything>, user X]` cannot step into
   someone else's conversation that opened with "Hi" (docs/security.md). Only a request that names its end
   user (OpenAI `user`, Anthropic `metadata.user_id`) may continue with a rewritten reply, inside that user's
   own sessions.

Every fingerprint is seeded with a *partition*: the agent, the client (a digest of the key it presents), the end
user it names, and its system messages; a session is never continued across any of them. Digits in system
messages are left out (a clock in the system prompt does not split a session; a different prompt does).
Messages are compared in a canonical form: role, text (stripped), tool calls by name and JSON-normalised
arguments (ids left out, clients rewrite them); the `prompt` match compares tool-call arguments too. A reply that
was empty (no text, no tool call) continues nothing: a stranger who knows the prompt knows that reply too.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from metaclaw.messages import content_text

SEP, US = b"\x1e", "\x1f"  # record and unit separators
DIGITS = re.compile(r"\d+")
NOT_WORD = re.compile(r"[\W_]+")


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


def loose(message: dict[str, Any] | None) -> str:
    """A reply as the `prompt` match compares it: letters and digits of its text and of its tool calls (names and
    JSON-normalised arguments: two calls of one tool with other arguments are other replies), lowercased."""
    if not message:
        return ""
    calls = [
        [str((tc.get("function") or {}).get("name", "")), _arguments((tc.get("function") or {}).get("arguments"))]
        for tc in message.get("tool_calls") or ()
        if isinstance(tc, dict)
    ]
    text = content_text(message.get("content")) + (json.dumps(calls, sort_keys=True, ensure_ascii=False) if calls
                                                   else "")  # fmt: skip
    return NOT_WORD.sub("", text.lower())


def edited(recorded: str, sent: str) -> bool:
    """Whether `sent` is the `recorded` reply lightly edited: equal, or one holds the other at half its length."""
    if recorded == sent:
        return True
    short, long = sorted((recorded, sent), key=len)
    return bool(short) and short in long and 2 * len(short) >= len(long)


def _seed(agent_id: str, partition: str, messages: list[dict[str, Any]]) -> Any:
    """The hash every fingerprint of a conversation starts from: agent, partition, system messages."""
    h = hashlib.blake2b(f"{agent_id}{US}{partition}".encode(), digest_size=16)
    for m in messages:
        if m.get("role") == "system":
            h.update(SEP + DIGITS.sub("#", content_text(m.get("content")).strip()).encode())
    return h


@dataclass(frozen=True)
class Tail:
    """The fingerprints a turn leaves for the next request of its conversation."""

    full: str
    last: str
    prompt: str
    reply: str = ""  # the reply, `loose`: a `prompt` match must carry a light edit of it
    opening: str = ""  # the exchange's first message + the reply ("" when the exchange has no message)

    def fingerprints(self) -> tuple[tuple[str, str], ...]:
        found = (("full", self.full), ("last", self.last), ("prompt", self.prompt))
        return (*found, ("opening", self.opening)) if self.opening else found


class Query:
    """One request's conversation: what it may continue (`candidates`) and how to build its own tail.

    Built in one pass over the messages (each hashed once; prefixes are copies of the running hash).
    """

    __slots__ = ("agent_id", "last_assistant", "reply", "lax", "_candidates", "_all", "_new", "_opening")

    def __init__(self, messages: list[dict[str, Any]], agent_id: str, partition: str = "", lax: bool = False) -> None:
        kept = [m for m in messages if m.get("role") != "system"]
        roles = [m.get("role") for m in kept]
        k = max((i for i, r in enumerate(roles) if r == "assistant"), default=-1)
        prev = max((i for i in range(k) if roles[i] == "assistant"), default=-1)
        seed = _seed(agent_id, partition, messages)
        everything, exchange, new, opening = seed.copy(), seed.copy(), seed.copy(), seed
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
        self.reply, self.lax = (loose(kept[k]) if k >= 0 else ""), lax  # lax: any reply continues (`user` named)
        self._opening = opening.copy()  # this request's exchange opens with its first new message
        if k + 1 < len(kept):
            self._opening.update(SEP + canonical(kept[k + 1]))
        else:
            self._opening = None
        candidates = [("full", full), ("last", exchange.hexdigest()), ("prompt", prompt)]
        if prev + 1 < k:  # the answered exchange had a message before its reply: its opening + the reply
            opening.update(SEP + canonical(kept[prev + 1]) + SEP + canonical(kept[k]))
            candidates.append(("opening", opening.hexdigest()))
        self._candidates = () if k < 0 else tuple(candidates)

    @classmethod
    def of(cls, messages: list[dict[str, Any]], agent_id: str, partition: str = "", lax: bool = False) -> Query:
        """`messages` as sent by `partition` (client and end user) of `agent_id`; `lax`: see `continues`."""
        return cls(messages, agent_id, partition, lax)

    def continues(self, kind: str, tail: Tail) -> bool:
        """Whether a session whose `tail` matched this request's `kind` fingerprint may take it: `full` and `last`
        include the reply; a `prompt` match needs a light edit of the recorded reply (`lax`: see the tracker).
        An empty reply (no text, no tool call) is known to anyone who knows the prompt: it never continues."""
        if not tail.reply or not self.reply:
            return False
        return kind != "prompt" or edited(tail.reply, self.reply)

    def candidates(self) -> tuple[tuple[str, str], ...]:
        """`(kind, fingerprint)` to look up, strongest first; empty for a conversation's first turn."""
        return self._candidates

    def tail(self, reply: dict[str, Any]) -> Tail:
        """The tail this request leaves once `reply` (the assistant message it got) is known."""
        part = SEP + canonical(reply)
        full, last = self._all.copy(), self._new.copy()
        full.update(part)
        last.update(part)
        opening = ""
        if self._opening is not None:
            first = self._opening.copy()
            first.update(part)
            opening = first.hexdigest()
        return Tail(full=full.hexdigest(), last=last.hexdigest(), prompt=self._all.hexdigest(), reply=loose(reply),
                    opening=opening)  # fmt: skip
