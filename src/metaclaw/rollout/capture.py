"""Turn capture: accumulate what the policy server returned (streamed or not) into a `Sample`.

The server reports the prompt as it rendered it (`prompt_token_ids`), the sampled `token_ids`, per-token
`logprobs` and the adapter version (`x-metaclaw-adapter-version` header or `adapter_version` field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from metaclaw.messages import answer_and_reasoning
from metaclaw.store import Sample, SampleText

EXTRA_CHOICE_FIELDS = ("token_ids",)
EXTRA_TOP_FIELDS = ("prompt_token_ids",)


@dataclass
class TurnCapture:
    """Everything known about one forwarded turn; filled from chunks (`feed_chunk`) or a response (`feed_response`)."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    adapter_version: int | None = None
    usage: dict[str, Any] | None = None
    error: Any = None  # what an upstream that failed mid-stream said (such a turn is never captured)

    def _top(self, body: dict[str, Any]) -> None:
        if body.get("prompt_token_ids") and not self.prompt_ids:
            self.prompt_ids = list(body["prompt_token_ids"])
        if body.get("adapter_version") is not None:
            self.adapter_version = int(body["adapter_version"])
        if body.get("usage"):
            self.usage = body["usage"]

    def _logprobs(self, choice: dict[str, Any]) -> None:
        lp = choice.get("logprobs") or {}
        for entry in lp.get("content") or []:
            self.logprobs.append(float(entry.get("logprob", 0.0)))

    def feed_chunk(self, chunk: dict[str, Any]) -> None:
        """Accumulate one streamed `chat.completion.chunk` (first choice only); an error chunk is kept as `error`."""
        if "error" in chunk and not chunk.get("choices"):
            self.error = chunk["error"]
            return
        self._top(chunk)
        choices = chunk.get("choices") or []
        if not choices:
            return
        choice = choices[0]
        if choice.get("prompt_token_ids") and not self.prompt_ids:
            self.prompt_ids = list(choice["prompt_token_ids"])
        self.response_ids.extend(choice.get("token_ids") or [])
        self._logprobs(choice)
        delta = choice.get("delta") or {}
        if delta.get("content"):
            self.content.append(delta["content"])
        if delta.get("reasoning_content"):
            self.reasoning.append(delta["reasoning_content"])
        for tc in delta.get("tool_calls") or []:
            slot = self.tool_calls.setdefault(
                int(tc.get("index", 0)), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if tc.get("id"):
                slot["id"] = tc["id"]
            fn = tc.get("function") or {}
            slot["function"]["name"] += fn.get("name") or ""
            slot["function"]["arguments"] += fn.get("arguments") or ""
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def feed_response(self, body: dict[str, Any]) -> None:
        """Take a whole `chat.completion` (first choice only)."""
        self._top(body)
        choice = (body.get("choices") or [{}])[0]
        if choice.get("prompt_token_ids") and not self.prompt_ids:
            self.prompt_ids = list(choice["prompt_token_ids"])
        self.response_ids = list(choice.get("token_ids") or [])
        self._logprobs(choice)
        msg = choice.get("message") or {}
        self.content = [msg.get("content") or ""]
        if msg.get("reasoning_content"):
            self.reasoning = [msg["reasoning_content"]]
        self.tool_calls = dict(enumerate(msg.get("tool_calls") or []))
        self.finish_reason = choice.get("finish_reason")

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def response_text(self) -> str:
        """The reply as a judge reads it: the answer (no reasoning: `<think>` blocks left inline by an upstream
        without a reasoning parser are cut, `reasoning_content` is kept apart) plus any tool calls."""
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        extra = "".join(f"\n[tool call] {json.dumps(c.get('function', c))}" for c in calls)
        return answer_and_reasoning({"content": self.text})[0] + extra

    def assistant_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return msg

    def problems(self) -> str | None:
        """Why this turn cannot become a sample (None when it can)."""
        if self.error is not None:
            return f"the upstream failed mid-stream: {self.error}"
        if not self.prompt_ids:
            return "the server returned no prompt_token_ids"
        if not self.response_ids:
            return "the server returned no token_ids"
        if len(self.logprobs) != len(self.response_ids):
            return f"{len(self.logprobs)} logprobs for {len(self.response_ids)} tokens"
        return None

    def to_sample(self, messages: list[dict[str, Any]] | None = None, **fields: Any) -> Sample:
        """A pending sample of the request's `messages`; `fields` are the session fields (agent_id, session_id,
        turn_index, ...)."""
        return Sample(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            behaviour_logprobs=self.logprobs,
            adapter_version=self.adapter_version or 0,
            text=SampleText(messages=messages, response_text=self.response_text),
            **fields,
        )


def split_sse(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The complete server-sent events in `buffer` (without their blank-line terminator) and the unfinished rest.

    CRLF line ends become LF; a CR split from its LF across reads waits in the rest and is joined next time.
    """
    if b"\r" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(b"\n\n")
    return events, rest


def sse_data(event: bytes) -> bytes | None:
    """The `data:` payload of one event (multi-line data joined by LF); None for comments and data-less events."""
    if event.startswith(b"data:") and b"\n" not in event:  # the usual one-line event
        return event[5:]
    lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def strip_extras(body: dict[str, Any], keep_logprobs: bool, keep_token_ids: bool) -> dict[str, Any]:
    """Remove the fields the proxy asked for on its own behalf from what the client sees (in place)."""
    if not keep_token_ids:
        for key in EXTRA_TOP_FIELDS:
            body.pop(key, None)
    for choice in body.get("choices") or []:
        if not keep_token_ids:
            for key in (*EXTRA_CHOICE_FIELDS, *EXTRA_TOP_FIELDS):
                choice.pop(key, None)
        if not keep_logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return body
