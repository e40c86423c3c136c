"""Chat message helpers shared by the proxy and the skills (no heavy imports)."""

from __future__ import annotations

import re
from typing import Any

TEXT_PART_TYPES = ("text", "input_text", "output_text")
TOOL_RESULT_PART_TYPES = ("toolResult", "tool_result")


def content_text(content: Any, sep: str = "") -> str:
    """The text of a message's content: a string, or the text parts of a list-of-parts joined with `sep`.

    OpenClaw's `toolResult` parts contribute their own content's text; images and other parts contribute none.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES:
                out.append(str(part.get("text", "")))
            elif isinstance(part, dict) and part.get("type") in TOOL_RESULT_PART_TYPES:
                out.append(content_text(part.get("content", part.get("text")), sep))
        return sep.join(out)
    return str(content)


_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.S)


def answer_and_reasoning(message: dict[str, Any] | None) -> tuple[str, str]:
    """A chat reply's answer and its reasoning, kept apart.

    Reasoning is what a thinking model writes before answering: the server's `reasoning_content` (vLLM,
    DeepSeek) or `reasoning` field, or `<think>...</think>` blocks left inline in `content` (an unclosed one runs
    to the end). The answer is `content` without them, so reasoning never passes for the answer.
    """
    message = message or {}
    content = content_text(message.get("content"))
    inline = [m.strip() for m in _THINK.findall(content)]
    answer = _THINK.sub("", content).replace("</think>", "").strip()
    fields = [content_text(message.get(k)) for k in ("reasoning_content", "reasoning")]
    reasoning = "\n".join(x for x in [*fields, *inline] if x and x.strip())
    return answer, reasoning


# Invisible characters that hide what text says (zero-width joiners, soft hyphens, bidi controls): the secret screen
# and the skill content rule read text without them.
ZERO_WIDTH = re.compile("[\u00ad\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff]")
