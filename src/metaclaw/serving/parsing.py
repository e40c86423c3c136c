"""Split generated text into reasoning (`<think>…</think>`), content and Qwen-style `<tool_call>` JSON calls.

`parse_completion` handles a whole completion; `StreamParser` does the same incrementally for SSE, holding back
only text that could still be the start of a tag.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)


def tool_call_from_json(text: str) -> dict[str, Any] | None:
    """An OpenAI `tool_calls` entry from `{"name": ..., "arguments": {...}}`; None if the JSON is not a call."""
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
    }


@dataclass
class ParsedCompletion:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest). A lone `</think>` means the template opened the block in the prompt (Qwen3)."""
    if THINK_CLOSE in text:
        head, rest = text.split(THINK_CLOSE, 1)
        reasoning = head.split(THINK_OPEN, 1)[1] if THINK_OPEN in head else head
        before = head.split(THINK_OPEN, 1)[0] if THINK_OPEN in head else ""
        return reasoning.strip("\n") or None, (before + rest).lstrip("\n")
    if THINK_OPEN in text:  # unterminated (cut by max_tokens): everything after the tag is reasoning
        before, reasoning = text.split(THINK_OPEN, 1)
        return reasoning.strip("\n") or None, before
    return None, text


def parse_completion(text: str, parse_tools: bool = True) -> ParsedCompletion:
    """Reasoning, content and tool calls of a complete generation; malformed calls stay in the content."""
    reasoning, rest = split_reasoning(text)
    calls: list[dict[str, Any]] = []
    if parse_tools and TOOL_OPEN in rest:

        def take(match: re.Match) -> str:
            call = tool_call_from_json(match.group(1))
            if call is None:
                return match.group(0)
            calls.append(call)
            return ""

        rest = _TOOL_BLOCK.sub(take, rest)
    content = rest.strip() if calls else rest
    return ParsedCompletion(content=content or (None if calls else ""), reasoning_content=reasoning, tool_calls=calls)


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                best = max(best, k)
                break
    return best


class StreamParser:
    """Incremental `parse_completion`: `feed(text)` / `finish()` return events for SSE deltas.

    Events are `("content", str)`, `("reasoning", str)` and `("tool_call", dict)`.
    """

    def __init__(self, parse_tools: bool = True) -> None:
        self.parse_tools = parse_tools
        self._buf = ""
        self._mode = "content"  # content | think | tool
        self.saw_tool_call = False

    def _tags(self) -> tuple[str, ...]:
        if self._mode == "think":
            return (THINK_CLOSE,)
        if self._mode == "tool":
            return (TOOL_CLOSE,)
        return (THINK_OPEN, THINK_CLOSE, TOOL_OPEN) if self.parse_tools else (THINK_OPEN, THINK_CLOSE)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        events: list[tuple[str, Any]] = []
        while True:
            tags = self._tags()
            hits = [(self._buf.find(t), t) for t in tags if t in self._buf]
            if not hits:
                break
            pos, tag = min(hits)
            before, self._buf = self._buf[:pos], self._buf[pos + len(tag) :]
            self._emit(events, before)
            if tag == THINK_OPEN:
                self._mode = "think"
            elif tag == TOOL_OPEN:
                self._mode = "tool"
            elif tag == TOOL_CLOSE:
                self._close_tool(events, before)
            else:  # </think>
                self._mode = "content"
        if self._mode != "tool":
            keep = _partial_tag_len(self._buf, self._tags())
            ready, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            self._emit(events, ready)
        return events

    def _emit(self, events: list[tuple[str, Any]], text: str) -> None:
        if not text or self._mode == "tool":
            return
        events.append(("reasoning" if self._mode == "think" else "content", text))

    def _close_tool(self, events: list[tuple[str, Any]], body: str) -> None:
        call = tool_call_from_json(body)
        if call is None:
            events.append(("content", f"{TOOL_OPEN}{body}{TOOL_CLOSE}"))
        else:
            self.saw_tool_call = True
            events.append(("tool_call", call))
        self._mode = "content"

    def finish(self) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        if self._mode == "tool":  # unterminated call: give the raw text back as content
            events.append(("content", TOOL_OPEN + self._buf))
        elif self._buf:
            events.append(("reasoning" if self._mode == "think" else "content", self._buf))
        self._buf = ""
        return events
