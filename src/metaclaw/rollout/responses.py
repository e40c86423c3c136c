"""OpenAI Responses API (`/v1/responses`, what Codex speaks) on top of the chat path: a Responses request in, an
OpenAI chat request out; a chat completion (or its chunks) in, a `response` object (or the Responses SSE events)
out. Message, `function_call` and `function_call_output` items both ways; `instructions` become the system prompt.

Every request carries the whole conversation: `previous_response_id` (server-side history) is refused with a 400
(the proxy keeps no transcripts: docs/clients.md), as are input items only OpenAI's hosted tools produce. Fields
that only OpenAI's own servers act on (`store`, `include`, `reasoning`, `text`, `prompt_cache_key`, ...) are
ignored.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from metaclaw.messages import content_text
from metaclaw.rollout.errors import stream_error
from metaclaw.wire import RequestError

log = logging.getLogger(__name__)

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: a string, or text + image_url parts when it has images."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}.content[{i}]"
        if not isinstance(part, dict):
            raise RequestError(f"{at} must be an object")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{at}.text must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal") or "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise RequestError(f"{at}: input_image needs an image_url (file_id is not supported here)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise RequestError(f"{at}: unsupported content part type {kind!r}")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return content_text(parts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, args = item.get("name"), item.get("arguments", "")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}: function_call needs a string name")
    if not isinstance(args, str):
        raise RequestError(f"{where}.arguments must be a JSON string")
    call_id = item.get("call_id") or item.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{where}: function_call needs a string call_id")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _as_function_call(item: dict[str, Any]) -> dict[str, Any]:
    """Codex's other call items as a function call: a freeform tool's `input` and a local shell's `action`
    become the JSON arguments `{"input": ...}` / the action object (what the model is trained to have written)."""
    if item.get("type") == "custom_tool_call":
        return {**item, "arguments": json.dumps({"input": item.get("input")})}
    if item.get("type") == "local_shell_call":
        return {**item, "name": "local_shell", "arguments": json.dumps(item.get("action"))}
    return item


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        text = _content(output, where)
        return text if isinstance(text, str) else content_text([p for p in text if p["type"] == "text"])
    raise RequestError(f"{where}.output must be a string or a list of content parts")


def to_chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses request's `instructions` + `input`. Raises `RequestError`."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a non-empty string or a non-empty list of items")
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{at} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{at}.role must be user, assistant, system or developer")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content(item.get("content"), at)})  # fmt: skip
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            call = _function_call(_as_function_call(item), at)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # parallel calls: one assistant message
                if not last.get("content"):
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{at}: function_call_output needs a string call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"), at)})
        elif kind == "reasoning":
            continue  # the model's own earlier reasoning: not part of the prompt, as chat templates drop it
        else:
            raise RequestError(
                f"{at}: unsupported input item type {kind!r} (supported: message, function_call, "
                "function_call_output, custom_tool_call(_output), local_shell_call(_output), reasoning)"
            )
    return messages


def to_chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools (flat `{type, name, parameters}`) as chat tools; OpenAI's hosted tools (web search,
    file search, ...) cannot run here and are left out, said in the log."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list")
    out, skipped = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}] must be an object")
        if tool.get("type") != "function":
            skipped.append(str(tool.get("type")))
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"tools[{i}]: a function tool needs a string name")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools[{i}].parameters must be an object")
        fn: dict[str, Any] = {"name": tool["name"], "parameters": params or {"type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    if skipped:
        log.warning("/v1/responses: hosted tools %s cannot run behind this proxy; the model is not offered them",
                    sorted(set(skipped)))  # fmt: skip
    return out or None


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") in ("allowed_tools",):
        return choice.get("mode", "auto")
    raise RequestError('tool_choice must be auto, none, required or {"type": "function", "name": ...}')


def to_chat_request(body: Any) -> dict[str, Any]:
    """An OpenAI chat request equivalent to a Responses request. Raises `RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise RequestError("previous_response_id is not supported: this proxy keeps no conversation state; send "
                           "the whole conversation in `input` (with store=false, as Codex does)")  # fmt: skip
    if body.get("conversation") is not None or body.get("prompt") is not None:
        raise RequestError("conversation and prompt (stored server-side objects) are not supported: send `input`")
    out: dict[str, Any] = {"model": body.get("model"), "messages": to_chat_messages(body),
                           "stream": bool(body.get("stream"))}  # fmt: skip
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise RequestError("max_output_tokens must be a positive integer")
        out["max_tokens"] = limit
    for key in ("temperature", "top_p", "user"):
        if body.get(key) is not None:
            out[key] = body[key]
    tools = to_chat_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            out["tool_choice"] = choice
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return out


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}  # fmt: skip


def _message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
        else []  # fmt: skip
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _call_item(call: dict[str, Any], item_id: str, status: str = "completed") -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.get("id") or _new_id("call"),
            "name": fn.get("name", ""), "arguments": fn.get("arguments") or ""}  # fmt: skip


def _reasoning_item(text: str, item_id: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


class ResponseShell:
    """What every `response` object of one request shares: the id, the request's echo, the status."""

    def __init__(self, request: dict[str, Any], response_id: str, model: Any) -> None:
        self.request, self.response_id, self.model = request, response_id, model
        self.created_at = int(time.time())

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             finish: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        req = self.request
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "error": error, "incomplete_details": incomplete,
            "instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
            "model": self.model, "output": output, "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": req.get("temperature"), "text": {"format": {"type": "text"}},
            "tool_choice": req.get("tool_choice", "auto"), "tools": req.get("tools") or [],
            "top_p": req.get("top_p"), "truncation": "disabled", "usage": usage,
            "user": req.get("user"), "metadata": req.get("metadata") or {},
        }  # fmt: skip


def to_response(chat: dict[str, Any], shell: ResponseShell) -> dict[str, Any]:
    """A Responses `response` from a `chat.completion`: reasoning, message and `function_call` output items."""
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(msg["reasoning_content"], _new_id("rs")))
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(_message_item(msg.get("content") or "", _new_id("msg")))
    output.extend(_call_item(tc, _new_id("fc")) for tc in msg.get("tool_calls") or [])
    u = chat.get("usage") or {}
    usage = _usage(int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)))
    return shell.body("completed", output, usage, choice.get("finish_reason"))


class ResponsesStream:
    """Turns OpenAI chat chunks into the Responses API's SSE events, as they arrive.

    The event sequence of OpenAI's own server: `response.created`, `response.in_progress`, per output item
    `response.output_item.added` → (`response.content_part.added`, `response.output_text.delta`…,
    `response.output_text.done`, `response.content_part.done` | `response.function_call_arguments.delta`…,
    `response.function_call_arguments.done`) → `response.output_item.done`; then `response.completed` (or
    `response.incomplete`, or `response.failed` when the upstream fails mid-stream).
    """

    def __init__(self, shell: ResponseShell) -> None:
        self.shell, self.seq = shell, 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its open item
        self.reasoning: list[str] = []
        self.finish: str | None = None
        self.usage = _usage(0, 0)
        self.output_tokens = 0

    def event(self, name: str, data: dict[str, Any]) -> bytes:
        payload = {"type": name, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()

    def start(self, input_tokens: int | None = None) -> bytes:
        if input_tokens is not None:
            self.usage = _usage(input_tokens, 0)
        body = self.shell.body("in_progress", [])
        return self.event("response.created", {"response": body}) + self.event("response.in_progress",
                                                                                {"response": body})  # fmt: skip

    def _index(self) -> int:
        return len(self.output)

    def _flush_reasoning(self) -> Iterator[bytes]:
        if not self.reasoning:
            return
        item = _reasoning_item("".join(self.reasoning), _new_id("rs"))
        self.reasoning = []
        idx = self._index()
        yield self.event("response.output_item.added", {"output_index": idx, "item": {**item, "summary": []}})
        yield self.event("response.output_item.done", {"output_index": idx, "item": item})
        self.output.append(item)

    def _close(self) -> Iterator[bytes]:
        item, self.open = self.open, None
        if item is None:
            return
        idx = self._index()
        if item["type"] == "message":
            text = item.pop("_text")
            done = _message_item(text, item["id"])
            part = done["content"][0]
            where = {"item_id": item["id"], "output_index": idx, "content_index": 0}
            yield self.event("response.output_text.done", {**where, "text": text, "logprobs": []})
            yield self.event("response.content_part.done", {**where, "part": part})
        else:
            done = {**item, "status": "completed"}
            yield self.event("response.function_call_arguments.done", {"item_id": item["id"], "output_index": idx,
                                                                       "arguments": item["arguments"],
                                                                       "name": item["name"]})  # fmt: skip
        yield self.event("response.output_item.done", {"output_index": idx, "item": done})
        self.output.append(done)

    def _open_text(self) -> Iterator[bytes]:
        yield from self._flush_reasoning()
        yield from self._close()
        item = _message_item("", _new_id("msg"), "in_progress")
        idx = self._index()
        yield self.event("response.output_item.added", {"output_index": idx, "item": item})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield self.event("response.content_part.added", {"item_id": item["id"], "output_index": idx,
                                                         "content_index": 0, "part": part})  # fmt: skip
        self.open = {**item, "_text": ""}

    def feed(self, chunk: dict[str, Any], n_tokens: int = 0) -> Iterator[bytes]:
        """Events for one chat chunk; `n_tokens`: how many sampled tokens it carried (for the usage)."""
        self.output_tokens += n_tokens
        u = chunk.get("usage")
        if u:
            self.usage = _usage(int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                self.reasoning.append(delta["reasoning_content"])
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    yield from self._open_text()
                assert self.open is not None  # _open_text opened it
                self.open["_text"] += delta["content"]
                yield self.event("response.output_text.delta", {
                    "item_id": self.open["id"], "output_index": self._index(), "content_index": 0,
                    "delta": delta["content"], "logprobs": []})  # fmt: skip
            for tc in delta.get("tool_calls") or []:
                i = int(tc.get("index", 0))
                fn = tc.get("function") or {}
                if i not in self.calls:
                    yield from self._flush_reasoning()
                    yield from self._close()
                    item = _call_item({"id": tc.get("id"), "function": {"name": fn.get("name", "")}},
                                      _new_id("fc"), "in_progress")  # fmt: skip
                    yield self.event("response.output_item.added", {"output_index": self._index(), "item": item})
                    self.calls[i] = self.open = item
                if fn.get("arguments"):
                    item = self.calls[i]
                    item["arguments"] += fn["arguments"]
                    yield self.event("response.function_call_arguments.delta", {
                        "item_id": item["id"], "output_index": self._index(), "delta": fn["arguments"]})  # fmt: skip
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def end(self) -> Iterator[bytes]:
        yield from self._flush_reasoning()
        yield from self._close()
        if not self.output:  # an empty reply is still one (empty) message, as the non-streamed shape has
            yield from self._open_text()
            yield from self._close()
        usage = self.usage
        if not usage["output_tokens"] and self.output_tokens:
            usage = _usage(usage["input_tokens"], self.output_tokens)
        body = self.shell.body("completed", self.output, usage, self.finish)
        name = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield self.event(name, {"response": body})

    def fail(self, error: Any) -> Iterator[bytes]:
        """The upstream failed mid-stream: `response.failed` with its message (the stream ends there)."""
        message, _, code = stream_error(error)
        err = {"code": code if isinstance(code, str) and code else "server_error", "message": message}
        yield self.event("response.failed", {"response": self.shell.body("failed", self.output, self.usage,
                                                                         error=err)})  # fmt: skip
