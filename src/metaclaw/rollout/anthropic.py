"""Anthropic Messages API on top of the OpenAI path: request in, OpenAI request out; OpenAI response/chunks in,
Anthropic message/events out (text and `tool_use` blocks)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from metaclaw.rollout.normalize import RequestError, content_text

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", None: "end_turn"}


def _blocks_to_messages(role: str, content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError("messages[].content must be a string or a list of content blocks")
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            src = block.get("source") or {}
            url = src.get("url") or f"data:{src.get('media_type', 'image/png')};base64,{src.get('data', '')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            args = json.dumps(block.get("input") or {})
            fn = {"name": block.get("name", ""), "arguments": args}
            tool_calls.append({"id": block.get("id", ""), "type": "function", "function": fn})
        elif kind == "tool_result":
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id", ""),
                    "content": content_text(block.get("content")),
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise RequestError(f"unsupported content block type {kind!r}")
    out: list[dict[str, Any]] = list(results)
    has_image = any(p["type"] == "image_url" for p in parts)
    if parts or tool_calls:
        msg: dict[str, Any] = {"role": role, "content": parts if has_image else content_text(parts)}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        out.append(msg)
    return out


def to_openai_request(body: Any) -> dict[str, Any]:
    """An OpenAI chat request equivalent to an Anthropic Messages request. Raises `RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestError("messages must be a non-empty list")
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        raise RequestError("max_tokens must be a positive integer")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": content_text(system)})
    for m in body["messages"]:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError("messages[].role must be user or assistant")
        messages.extend(_blocks_to_messages(m["role"], m.get("content")))
    out: dict[str, Any] = {
        "model": body.get("model"),
        "messages": messages,
        "max_tokens": body["max_tokens"],
        "stream": bool(body.get("stream")),
    }
    for src, dst in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop_sequences", "stop"),
    ):
        if body.get(src) is not None:
            out[dst] = body[src]
    if body.get("tools"):
        out["tools"] = body["tools"]  # normalised to OpenAI tools by the proxy
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        out["tool_choice"] = (
            {"type": "function", "function": {"name": choice.get("name")}}
            if kind == "tool"
            else {"any": "required", "auto": "auto", "none": "none"}.get(kind, "auto")
        )
    return out


def _usage(body: dict[str, Any]) -> dict[str, int]:
    u = body.get("usage") or {}
    return {"input_tokens": int(u.get("prompt_tokens", 0)), "output_tokens": int(u.get("completion_tokens", 0))}


def _tool_use(tc: dict[str, Any]) -> dict[str, Any]:
    fn = tc.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        args = {"_raw": fn.get("arguments")}
    return {
        "type": "tool_use",
        "id": tc.get("id") or f"toolu_{uuid.uuid4().hex[:12]}",
        "name": fn.get("name", ""),
        "input": args,
    }


def to_anthropic_response(body: dict[str, Any], model: str | None) -> dict[str, Any]:
    """An Anthropic `message` from an OpenAI `chat.completion` (text and tool_use blocks)."""
    choice = (body.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content.extend(_tool_use(tc) for tc in msg.get("tool_calls") or [])
    return {
        "id": f"msg_{body.get('id') or uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model or body.get("model"),
        "content": content,
        "stop_reason": STOP_REASONS.get(choice.get("finish_reason"), "end_turn"),
        "stop_sequence": None,
        "usage": _usage(body),
    }


class AnthropicStream:
    """Turns OpenAI chunks into Anthropic SSE events, as they arrive."""

    def __init__(self, model: str | None) -> None:
        self.model, self.index, self.open_kind = model, -1, None
        self.tool_index: dict[int, int] = {}
        self.finish: str | None = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    @staticmethod
    def event(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    def start(self) -> bytes:
        msg = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.usage,
        }
        return self.event("message_start", {"type": "message_start", "message": msg})

    def _open(self, kind: str, block: dict[str, Any]) -> Iterator[bytes]:
        yield from self._close()
        self.index += 1
        self.open_kind = kind
        yield self.event(
            "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}
        )

    def _close(self) -> Iterator[bytes]:
        if self.open_kind is not None:
            yield self.event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open_kind = None

    def feed(self, chunk: dict[str, Any]) -> Iterator[bytes]:
        if chunk.get("usage"):
            self.usage = _usage(chunk)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open_kind != "text":
                    yield from self._open("text", {"type": "text", "text": ""})
                d = {"type": "text_delta", "text": delta["content"]}
                yield self.event(
                    "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": d}
                )
            for tc in delta.get("tool_calls") or []:
                i = int(tc.get("index", 0))
                fn = tc.get("function") or {}
                if i not in self.tool_index:
                    block = {
                        "type": "tool_use",
                        "id": tc.get("id") or f"toolu_{uuid.uuid4().hex[:12]}",
                        "name": fn.get("name", ""),
                        "input": {},
                    }
                    yield from self._open(f"tool{i}", block)
                    self.tool_index[i] = self.index
                if fn.get("arguments"):
                    d = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                    yield self.event(
                        "content_block_delta", {"type": "content_block_delta", "index": self.tool_index[i], "delta": d}
                    )
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def end(self) -> Iterator[bytes]:
        yield from self._close()
        delta = {"stop_reason": STOP_REASONS.get(self.finish, "end_turn"), "stop_sequence": None}
        yield self.event("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage})
        yield self.event("message_stop", {"type": "message_stop"})
