"""Replay driver: plays example multi-turn conversations against the proxy with the real `openai` client.

User (and tool-result) turns come from a JSONL file, assistant turns are generated live by the policy, so a
newcomer can watch turns being captured, scored, trained on and hot-swapped without an agent. Conversations
alternate between sending the session headers (with `X-Session-Done` on the last turn) and sending none (the
proxy derives the session), and between streaming and not.

File format, one conversation per line: `{"name", "system", "turns": [str | {"role": "tool", "content"}],
"tools"?: [OpenAI tools]}`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metaclaw.thinking import Thinking
from metaclaw.wire.client import Endpoint, openai_client

log = logging.getLogger(__name__)


def load_conversations(path: str | Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        if not isinstance(row.get("turns"), list) or not row["turns"]:
            raise ValueError(f"{path}: conversation {i} has no turns")
    return rows


class ReplayDriver:
    """Drives the proxy at `base_url` (`.../v1`) from a thread until `cycles` are done or `stop()`.

    Args:
        base_url: the proxy's OpenAI base URL.
        file: the conversations (JSONL).
        cycles: passes over the file; None: until stopped.
        model: the `model` field sent (the proxy maps it to the policy).
        max_tokens: per assistant turn.
        temperature: sampling temperature sent.
        api_key: the proxy's key, if it has one.
        pause_s: pause between turns.
        timeout_s: per request.
        thinking: `model.thinking` (`metaclaw.thinking.Thinking`): `chat_template_kwargs` sent, budget added.
    """

    def __init__(
        self,
        base_url: str,
        file: str,
        cycles: int | None = None,
        model: str = "metaclaw",
        max_tokens: int = 48,
        temperature: float = 1.0,
        api_key: str | None = None,
        pause_s: float = 0.0,
        timeout_s: float = 300.0,
        thinking: Thinking | Mapping[str, Any] | None = None,
    ) -> None:
        self.conversations = load_conversations(file)
        self.client = openai_client(Endpoint(base_url, api_key), timeout_s, max_retries=1)  # with or without /v1
        self.cycles, self.model, self.max_tokens, self.temperature = cycles, model, max_tokens, temperature
        self.pause_s, self.thinking = pause_s, Thinking.of(thinking)
        self.turns_sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def play(self, conv: dict[str, Any], cycle: int, index: int) -> None:
        """One conversation, turn by turn."""
        with_headers = index % 2 == 0
        stream = (cycle + index) % 2 == 1
        system = conv.get("system", "")
        session = f"{conv.get('name', index)}-c{cycle}"
        if not with_headers:  # the proxy derives the session from the conversation; the system line is a label
            system = f"{system}\n(replay {session})"
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        turns = conv["turns"]
        for t, turn in enumerate(turns):
            if self._stop.is_set():
                return
            last_call = messages[-1].get("tool_calls") if messages and messages[-1]["role"] == "assistant" else None
            if isinstance(turn, dict) and turn.get("role") == "tool" and last_call:
                messages.append({"role": "tool", "tool_call_id": last_call[0]["id"], "content": turn["content"]})
            else:
                text = turn["content"] if isinstance(turn, dict) else turn
                messages.append({"role": "user", "content": text if isinstance(turn, str) else f"Tool output: {text}"})
            headers = {}
            if with_headers:
                headers = {"X-Session-Id": session, "X-Turn-Type": "main", "X-Agent-Id": "replay"}
                if t == len(turns) - 1:
                    headers["X-Session-Done"] = "true"
            messages.append(self._ask(messages, conv.get("tools"), headers, stream))
            self.turns_sent += 1
            self._stop.wait(self.pause_s)

    def _ask(self, messages: list[dict[str, Any]], tools: Any, headers: dict[str, str], stream: bool) -> dict:
        fields = self.thinking.fields(self.max_tokens)
        kwargs: dict[str, Any] = dict(
            model=self.model,
            messages=messages,
            max_tokens=fields.pop("max_tokens"),
            temperature=self.temperature,
            extra_headers=headers,
            extra_body=fields or None,
        )
        if tools:
            kwargs["tools"] = tools
        if not stream:
            msg = self.client.chat.completions.create(**kwargs).choices[0].message
            out: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
            if msg.tool_calls:
                out["tool_calls"] = [tc.model_dump() for tc in msg.tool_calls]
            return out
        text, calls = [], {}
        for chunk in self.client.chat.completions.create(stream=True, **kwargs):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            text.append(delta.content or "")
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(
                    tc.index,
                    {"id": tc.id or f"call_{tc.index}", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if tc.function:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
        out = {"role": "assistant", "content": "".join(text)}
        if calls:
            out["tool_calls"] = [calls[i] for i in sorted(calls)]
        return out

    def run(self) -> None:
        cycle = 0
        while not self._stop.is_set() and (self.cycles is None or cycle < self.cycles):
            for i, conv in enumerate(self.conversations):
                if self._stop.is_set():
                    break
                try:
                    self.play(conv, cycle, i)
                except Exception as e:  # noqa: BLE001 - the driver keeps going; the proxy logs the details
                    if not self._stop.is_set():
                        log.warning("Replay of %s failed: %r", conv.get("name"), e)
                        self._stop.wait(1.0)
            log.info("Replay cycle %d done (%d turns sent)", cycle, self.turns_sent)
            cycle += 1

    def start(self) -> ReplayDriver:
        self._thread = threading.Thread(target=self.run, name="replay-driver", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout)
