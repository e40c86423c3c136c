"""Message normalisation: whatever the agent sends becomes plain OpenAI chat messages the chat template renders.

Handled: OpenClaw's list-of-parts content (`text`, `image`/`image_url`, `toolCall`, `toolResult`, `thinking`),
its `toolResult` role, the `developer` role, and tools given in Anthropic's shape. Text-only part lists are
flattened to a string (chat templates render strings); images become canonical OpenAI `image_url` parts (what
happens to them next is the proxy's image policy, `metaclaw.rollout.fit`). Every shape mistake is a
`RequestError` naming the field (answered with 400), never an exception from deep inside.

Two entry points: `normalize_messages` (the proxy: whatever an agent sends → OpenAI chat messages) and
`chat_template_messages` (the policy server: refuses anything but text, so the template never sees a stranger).
"""

from __future__ import annotations

import json
import re
from typing import Any

from metaclaw.messages import TEXT_PART_TYPES, content_text
from metaclaw.wire import RequestError

IMAGE_PARTS = ("image", "image_url", "input_image")
ROLES = ("system", "developer", "user", "assistant", "tool")  # what the policy server's template accepts


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _str(value: Any, where: str, default: str = "") -> str:
    if value is None:
        return default
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise RequestError(f"{where} must be a string, got {type(value).__name__}")
    return str(value)


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return "{}"
    if not isinstance(value, dict | list):
        raise RequestError(f"{where} must be a JSON string or an object")
    return json.dumps(value)


def _tool_call(part: Any, where: str) -> dict[str, Any]:
    part = _obj(part, where)
    fn = _obj(part["function"], f"{where}.function") if "function" in part else part
    return {
        "id": _str(part.get("id") or part.get("toolCallId"), f"{where}.id"),
        "type": "function",
        "function": {
            "name": _str(fn.get("name"), f"{where}.function.name"),
            "arguments": _arguments(fn.get("arguments", fn.get("input")), f"{where}.function.arguments"),
        },
    }


def image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """Any client's image part → OpenAI `{"type": "image_url", "image_url": {"url": ...}}`.

    Shapes: OpenAI `image_url` (`{url}` or a bare string), Responses `input_image` (`image_url` string), OpenClaw
    `{type: "image", data, mimeType}` and `{type: "image", url}`.
    """
    url = part.get("image_url", part.get("url"))
    if isinstance(url, dict):
        url = url.get("url")
    if url is None and part.get("data") is not None:
        data = _str(part.get("data"), f"{where}.data")
        mime = _str(part.get("mimeType", part.get("mime_type", part.get("media_type"))), f"{where}.mimeType")
        url = f"data:{mime or 'image/png'};base64,{data}"
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}: an image part needs image_url.url, url or data")
    return {"type": "image_url", "image_url": {"url": url}}


def _normalize_one(msg: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], bool]:
    """One incoming message → one or more OpenAI messages, and whether it carried an image."""
    role = msg.get("role")
    if role == "developer":
        role = "system"
    if role == "toolResult":
        text = content_text(_content(msg.get("content"), where))
        call_id = _str(msg.get("toolCallId", msg.get("tool_call_id")), f"{where}.toolCallId")
        return [{"role": "tool", "tool_call_id": call_id, "content": text}], False
    if role not in ("system", "user", "assistant", "tool"):
        raise RequestError(f"{where}.role must be system|developer|user|assistant|tool, got {role!r}")
    content = _content(msg.get("content"), where)
    out: dict[str, Any] = {"role": role}
    raw_calls = msg.get("tool_calls")
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    tool_calls = [_tool_call(tc, f"{where}.tool_calls[{i}]") for i, tc in enumerate(raw_calls or [])]
    tool_results: list[dict[str, Any]] = []
    has_image = False
    if isinstance(content, list):
        kept: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if isinstance(part, str):
                kept.append({"type": "text", "text": part})
                continue
            part = _obj(part, at)
            kind = part.get("type")
            if kind == "toolCall":
                tool_calls.append(_tool_call(part, at))
            elif kind == "toolResult":
                call_id = _str(part.get("toolCallId", part.get("id")), f"{at}.toolCallId")
                result = _content(part.get("content", part.get("text")), at)
                tool_results.append({"role": "tool", "tool_call_id": call_id, "content": content_text(result)})
            elif kind in IMAGE_PARTS:
                has_image = True
                kept.append(image_part(part, at))
            elif kind in ("thinking", "reasoning"):
                continue
            elif kind is None or isinstance(kind, str):
                kept.append({"type": "text", "text": content_text([part])})
            else:
                raise RequestError(f"{at}.type must be a string")
        content = kept if has_image else content_text(kept)
    out["content"] = content if content is not None else ("" if role != "assistant" else None)
    if tool_calls:
        out["tool_calls"] = tool_calls
    if role == "tool":
        out["tool_call_id"] = _str(msg.get("tool_call_id"), f"{where}.tool_call_id")
        out["content"] = content_text(content)
    if msg.get("name") and role != "tool":
        out["name"] = _str(msg["name"], f"{where}.name")
    if tool_results and role == "user" and not content_text(content) and not has_image:
        return tool_results, has_image  # a user turn that only carries tool results
    return [out, *tool_results], has_image


def _content(content: Any, where: str) -> str | list | None:
    if content is None or isinstance(content, str | list):
        return content
    raise RequestError(f"{where}.content must be a string, a list of parts or null")


def normalize_messages(messages: Any) -> tuple[list[dict[str, Any]], bool]:
    """OpenAI chat messages from whatever the agent sent, and whether any message carries an image.

    Raises:
        RequestError: when `messages` is not a non-empty list of role-tagged objects of a known shape.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    has_image = False
    for i, msg in enumerate(messages):
        converted, image = _normalize_one(_obj(msg, f"messages[{i}]"), f"messages[{i}]")
        out.extend(converted)
        has_image |= image
    return out, has_image


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI `tools` from OpenAI- or Anthropic-shaped tool definitions (`name`/`description`/`input_schema`)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list")
    out = []
    for i, t in enumerate(tools):
        t = _obj(t, f"tools[{i}]")
        if t.get("type") == "function" and "function" in t:
            fn = _obj(t["function"], f"tools[{i}].function")
            _str(fn.get("name"), f"tools[{i}].function.name")
            if fn.get("parameters") is not None:
                _obj(fn["parameters"], f"tools[{i}].function.parameters")
            out.append(t)
        elif "name" in t:
            params = t["input_schema"] if "input_schema" in t else t.get("parameters")
            params = {"type": "object", "properties": {}} if params is None else params
            fn = {
                "name": _str(t["name"], f"tools[{i}].name"),
                "description": _str(t.get("description"), f"tools[{i}].description"),
                "parameters": _obj(params, f"tools[{i}].input_schema"),
            }
            out.append({"type": "function", "function": fn})
        else:
            raise RequestError(f"tools[{i}] must be an OpenAI function tool or an Anthropic tool with a name")
    return out or None


# What agents write into a user message that the person did not: a whole-line tagged block (Claude Code's
# `<system-reminder>` after a reply cut at max_tokens), a `<<<BEGIN_…>>> … <<<END_…>>>` block (OpenClaw's internal
# context), and a leading timestamp envelope (OpenClaw's `[Sat 2026-11-28 18:12 UTC] `).
_AGENT_BLOCKS = (
    re.compile(r"(?m)^[ \t]*<([a-z][a-z0-9_-]*)>[ \t]*\n[\s\S]*?\n[ \t]*</\1>[ \t]*$"),
    re.compile(r"<<<BEGIN_([A-Z0-9_]+)>>>[\s\S]*?<<<END_\1>>>"),
)
_ENVELOPE = re.compile(
    r"^\s*\[(?:[A-Z][a-z]{2},? )?\d{4}-\d{2}-\d{2}[ T]\d{1,2}:\d{2}(?::\d{2})?"  # [Sat 2026-11-28 18:12
    r"(?: ?(?:[A-Z]{2,5}|Z|[+-]\d{2}:?\d{2}))?\]\s*"  # UTC]
)


def person_text(text: str) -> str:
    """A user message's text without what the agent wrote into it (`_AGENT_BLOCKS`, `_ENVELOPE`): the person's
    words, which the reaction judge reads. "" when the agent wrote all of it (a continuation it sent itself)."""
    for block in _AGENT_BLOCKS:
        text = block.sub("", text)
    return _ENVELOPE.sub("", text, count=1).strip()


def next_state_text(new_messages: list[dict[str, Any]]) -> str:
    """The environment's reply to a turn (new user/tool messages) as one text, for judges: tool results marked as
    such, a user message reduced to the person's words (`person_text`); "" when none of it is either."""
    parts = []
    for m in new_messages:
        text = content_text(m.get("content"))
        parts.append(f"[tool result] {text}" if m.get("role") == "tool" else person_text(text))
    return "\n".join(p for p in parts if p)


def _strict_text(content: Any, where: str) -> str:
    """String content, or the text parts of a list-of-parts content joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}: content part of type {kind!r} is not supported (text only)", param=where)
        return "".join(texts)
    raise RequestError(f"{where}.content must be a string, a list of parts or null", param=where)


def chat_template_messages(messages: Any) -> list[dict[str, Any]]:
    """The policy server's strict check: chat-template-ready messages (text content only, `developer` as
    `system`, tool calls kept); anything else is a `RequestError` naming the field (`param`)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(f"{where} must be an object", param=where)
        role = msg.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=where)
        item: dict[str, Any] = {"role": "system" if role == "developer" else role}
        item["content"] = _strict_text(msg.get("content"), where)
        if role == "assistant" and msg.get("tool_calls"):
            calls = msg["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) and "function" in c for c in calls):
                raise RequestError(f"{where}.tool_calls must be a list of {{function: ...}} objects", param=where)
            item["tool_calls"] = calls
        if role == "tool" and msg.get("tool_call_id") is not None:
            item["tool_call_id"] = msg["tool_call_id"]
        if msg.get("name") is not None:
            item["name"] = msg["name"]
        out.append(item)
    return out
