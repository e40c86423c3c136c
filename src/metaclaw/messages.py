"""Chat message helpers shared by the proxy and the skills (no heavy imports)."""

from __future__ import annotations

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
