"""Message normalisation: whatever the agent sends becomes plain OpenAI chat messages the chat template renders.

Handled: OpenClaw's list-of-parts content (`text`, `image`/`image_url`, `toolCall`, `toolResult`, `thinking`),
its `toolResult` role, the `developer` role, and tools given in Anthropic's shape. Text-only part lists are
flattened to a string (chat templates render strings); images are kept as parts so they still reach the
server, and the turn is flagged so it is not trained on.
"""

from __future__ import annotations

import json
from typing import Any

from metaclaw.messages import content_text

IMAGE_PARTS = ("image", "image_url", "input_image")


class RequestError(ValueError):
    """A request the proxy refuses with a 400; the message says which field is wrong."""


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {})


def _tool_call(part: dict[str, Any]) -> dict[str, Any]:
    fn = part.get("function") or part
    return {
        "id": str(part.get("id") or part.get("toolCallId") or ""),
        "type": "function",
        "function": {"name": str(fn.get("name", "")), "arguments": _arguments(fn.get("arguments", fn.get("input")))},
    }


def _normalize_one(msg: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """One incoming message → one or more OpenAI messages, and whether it carried an image."""
    role = msg.get("role")
    if role == "developer":
        role = "system"
    if role == "toolResult":
        text = content_text(msg.get("content"))
        call_id = str(msg.get("toolCallId", msg.get("tool_call_id", "")))
        return [{"role": "tool", "tool_call_id": call_id, "content": text}], False
    if role not in ("system", "user", "assistant", "tool"):
        raise RequestError(f"messages[].role must be system|developer|user|assistant|tool, got {role!r}")
    content = msg.get("content")
    out: dict[str, Any] = {"role": role}
    tool_calls = [_tool_call(tc) for tc in msg.get("tool_calls") or []]
    tool_results: list[dict[str, Any]] = []
    has_image = False
    if isinstance(content, list):
        kept: list[dict[str, Any]] = []
        for part in content:
            if not isinstance(part, dict):
                kept.append({"type": "text", "text": str(part)})
                continue
            kind = part.get("type")
            if kind == "toolCall":
                tool_calls.append(_tool_call(part))
            elif kind == "toolResult":
                tool_results.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(part.get("toolCallId", part.get("id", ""))),
                        "content": content_text(part.get("content", part.get("text"))),
                    }
                )
            elif kind in IMAGE_PARTS:
                has_image = True
                kept.append(part)
            elif kind in ("thinking", "reasoning"):
                continue
            else:
                kept.append({"type": "text", "text": content_text([part])})
        content = kept if has_image else content_text(kept)
    elif content is not None and not isinstance(content, str):
        raise RequestError("messages[].content must be a string, a list of parts or null")
    out["content"] = content if content is not None else ("" if role != "assistant" else None)
    if tool_calls:
        out["tool_calls"] = tool_calls
    if role == "tool":
        out["tool_call_id"] = str(msg.get("tool_call_id", ""))
        out["content"] = content_text(content)
    if msg.get("name") and role != "tool":
        out["name"] = msg["name"]
    if tool_results and role == "user" and not content_text(content) and not has_image:
        return tool_results, has_image  # a user turn that only carries tool results
    return [out, *tool_results], has_image


def normalize_messages(messages: Any) -> tuple[list[dict[str, Any]], bool]:
    """OpenAI chat messages from whatever the agent sent, and whether any message carries an image.

    Raises:
        RequestError: when `messages` is not a non-empty list of role-tagged objects.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    has_image = False
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RequestError(f"messages[{i}] must be an object")
        converted, image = _normalize_one(msg)
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
    for t in tools:
        if not isinstance(t, dict):
            raise RequestError("tools[] must be objects")
        if t.get("type") == "function" and "function" in t:
            out.append(t)
        elif "name" in t:
            params = t.get("input_schema", t.get("parameters")) or {"type": "object", "properties": {}}
            fn = {"name": t["name"], "description": t.get("description", ""), "parameters": params}
            out.append({"type": "function", "function": fn})
        else:
            raise RequestError("tools[] must be OpenAI function tools or Anthropic tools with a name")
    return out or None


def next_state_text(new_messages: list[dict[str, Any]]) -> str:
    """The environment's reply to a turn (new user/tool messages) as one text, for judges."""
    parts = []
    for m in new_messages:
        text = content_text(m.get("content"))
        parts.append(f"[tool result] {text}" if m.get("role") == "tool" else text)
    return "\n".join(p for p in parts if p)
