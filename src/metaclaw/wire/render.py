"""The one prompt renderer: messages (+ tools, + `chat_template_kwargs`) → prompt token ids, as the policy server
renders them. The server, the seed filler, the OPD teacher's prompt and the proxy's context fit all call it, so
behaviour, training and teacher logprobs are taken over the same prompt. Light: no torch, no engine.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

_PROBE = "metaclaw_probe_fn"
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_tool_support(tokenizer: Any) -> tuple[bool, bool]:
    """(renders tool definitions, renders assistant tool calls) for this tokenizer's chat template, probed once.

    SmolLM2's template, for one, renders neither: the model would never see an agent's tools nor its own calls.
    """
    template = getattr(tokenizer, "chat_template", None)
    cached = getattr(tokenizer, "_metaclaw_tool_support", None)
    if cached is not None and cached[0] == template:
        return cached[1]
    fn = {"name": _PROBE, "parameters": {"type": "object", "properties": {}}}
    user = {"role": "user", "content": "x"}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c0", "type": "function", "function": {"name": _PROBE, "arguments": "{}"}}],
    }

    def renders(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses the shape does not render it
            return False
        return isinstance(text, str) and _PROBE in text

    support = (renders([user], [{"type": "function", "function": fn}]),
               renders([user, call, {"role": "tool", "tool_call_id": "c0", "content": "r"}], None))  # fmt: skip
    with contextlib.suppress(AttributeError):  # a tokenizer that takes no attributes is probed each time
        tokenizer._metaclaw_tool_support = (template, support)
    return support


def _hermes_call(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    args: Any = fn.get("arguments", "{}")
    with contextlib.suppress(ValueError):  # else kept as the string the model wrote
        args = json.loads(args) if isinstance(args, str) else args
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>"


def with_tools_in_text(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, defs: bool, calls: bool,
) -> list[dict[str, Any]]:  # fmt: skip
    """The conversation with what the template cannot render written as text, in the Hermes format the server's
    tool-call parser reads (`serve.tool_call_format`): tool definitions at the end of the system prompt, the
    assistant's calls as `<tool_call>` blocks, tool results inside `<tool_response>`."""
    out = [dict(m) for m in messages]
    if tools and not defs:
        block = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    if not calls:
        for m in out:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                text = m.get("content") if isinstance(m.get("content"), str) else ""
                m["content"] = "\n".join([t for t in (text,) if t] + [_hermes_call(c) for c in m.pop("tool_calls")])
            elif m.get("role") == "tool" and isinstance(m.get("content"), str):
                m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
    return out


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The chat template applied with the generation prompt, tokenised; template errors propagate.

    Tools and tool calls a template cannot render are written into the text (`with_tools_in_text`), so a model
    whose template ignores them still sees an agent's tools and its own calls.
    """
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        defs, calls = template_tool_support(tokenizer)
        if not (defs and calls):
            messages = with_tools_in_text(messages, tools, defs, calls)
            tools = tools if defs else None
    ids = tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=True,
        **dict(template_kwargs or {}),
    )  # fmt: skip
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
