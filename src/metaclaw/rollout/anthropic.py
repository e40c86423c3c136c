"""Anthropic Messages API on top of the OpenAI path: request in, OpenAI request out; OpenAI response/chunks in,
Anthropic message/events out (text and `tool_use` blocks)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from metaclaw.messages import content_text
from metaclaw.rollout.errors import stream_error
from metaclaw.wire import RequestError

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", None: "end_turn"}


def _image_url(block: dict[str, Any], where: str) -> dict[str, Any]:
    src = block.get("source")
    if not isinstance(src, dict):
        raise RequestError(f"{where}.source must be an object")
    if src.get("type") == "url" or "url" in src:
        url = src.get("url")
    else:
        data = src.get("data")
        url = f"data:{src.get('media_type') or 'image/png'};base64,{data}" if isinstance(data, str) else None
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}.source needs data (base64) or url")
    return {"type": "image_url", "image_url": {"url": url}}


def _blocks_to_messages(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks")
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        if not isinstance(block, dict):
            raise RequestError(f"{at} must be an object")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise RequestError(f"{at}.text must be a string")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_url(block, at))
        elif kind == "tool_use":
            if not isinstance(block.get("input", {}), dict) or not isinstance(block.get("name"), str):
                raise RequestError(f"{at}: tool_use needs a string name and an object input")
            args = json.dumps(block.get("input") or {})
            fn = {"name": block["name"], "arguments": args}
            tool_calls.append({"id": str(block.get("id", "")), "type": "function", "function": fn})
        elif kind == "tool_result":
            inner = block.get("content")
            if inner is not None and not isinstance(inner, str | list):
                raise RequestError(f"{at}.content must be a string or a list of blocks")
            results.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": content_text(inner)}
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise RequestError(f"{at}: unsupported content block type {kind!r}")
    out: list[dict[str, Any]] = list(results)
    has_image = any(p["type"] == "image_url" for p in parts)
    if parts or tool_calls:
        msg: dict[str, Any] = {"role": role, "content": parts if has_image else content_text(parts)}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        out.append(msg)
    return out


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list) or not all(isinstance(b, dict) and isinstance(b.get("text"), str) for b in system):
        raise RequestError("system must be a string or a list of text blocks")
    return content_text(system)


def to_openai_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The OpenAI messages of an Anthropic request's `system` + `messages`. Raises `RequestError`."""
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestError("messages must be a non-empty list")
    messages: list[dict[str, Any]] = []
    if body.get("system"):
        messages.append({"role": "system", "content": _system_text(body["system"])})
    for i, m in enumerate(body["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise RequestError(f"messages[{i}].role must be user, assistant or system")
        if m["role"] == "system":  # Claude Code 2.x sends its environment notes as a system turn mid-conversation
            messages.append({"role": "system", "content": _system_text(m.get("content"))})
            continue
        messages.extend(_blocks_to_messages(m["role"], m.get("content"), f"messages[{i}]"))
    return messages


def to_openai_request(body: Any) -> dict[str, Any]:
    """An OpenAI chat request equivalent to an Anthropic Messages request. Raises `RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError("max_tokens must be a positive integer")
    messages = to_openai_messages(body)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops)):
        raise RequestError("stop_sequences must be a list of non-empty strings")
    out: dict[str, Any] = {
        "model": body.get("model"),
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": bool(body.get("stream")),
    }
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}  # real counts for message_delta
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
    if body.get("chat_template_kwargs") is not None:  # vLLM's extension (Qwen3's enable_thinking); checked as OpenAI's
        out["chat_template_kwargs"] = body["chat_template_kwargs"]
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, dict):
        raise RequestError("tool_choice must be an object")
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


def stop_fields(finish_reason: str | None, stop_reason: Any) -> dict[str, Any]:
    """Anthropic's `stop_reason` / `stop_sequence` from OpenAI's `finish_reason` and vLLM's `stop_reason` (the
    stop string that ended the reply; our policy server reports it too)."""
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None}


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
        **stop_fields(choice.get("finish_reason"), choice.get("stop_reason")),
        "usage": _usage(body),
    }


class AnthropicStream:
    """Turns OpenAI chunks into Anthropic SSE events, as they arrive."""

    def __init__(self, model: str | None, message_id: str | None = None) -> None:
        self.model, self.index, self.open_kind = model, -1, None
        self.message_id = message_id or f"msg_{uuid.uuid4().hex}"
        self.tool_index: dict[int, int] = {}
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.output_tokens = 0  # counted from the chunks' token ids when upstream sends no usage

    @staticmethod
    def event(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    def start(self, input_tokens: int | None = None) -> bytes:
        """`message_start`; `input_tokens`: the prompt's length as the server rendered it."""
        if input_tokens is not None:
            self.usage = {**self.usage, "input_tokens": input_tokens}
        msg = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.usage["input_tokens"], "output_tokens": 1},
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

    def feed(self, chunk: dict[str, Any], n_tokens: int = 0) -> Iterator[bytes]:
        """Events for one OpenAI chunk; `n_tokens`: how many sampled tokens it carried (for the usage)."""
        self.output_tokens += n_tokens
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
                self.stop_reason = choice.get("stop_reason")

    def end(self) -> Iterator[bytes]:
        yield from self._close()
        delta = stop_fields(self.finish, self.stop_reason)
        usage = {**self.usage, "output_tokens": self.usage["output_tokens"] or self.output_tokens}
        yield self.event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        yield self.event("message_stop", {"type": "message_stop"})

    def fail(self, error: Any) -> Iterator[bytes]:
        """The upstream failed mid-stream: Anthropic's `event: error` (the stream ends there, no `message_stop`)."""
        message, type_, _ = stream_error(error)
        kind = "overloaded_error" if type_ == "overloaded_error" else "api_error"
        yield self.event("error", {"type": "error", "error": {"type": kind, "message": message}})
