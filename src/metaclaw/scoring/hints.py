"""OPD's hindsight hint: the teacher sees the prompt plus a hint distilled from the next state (seed 002)."""

from __future__ import annotations

import copy
from typing import Any

HINT_TEMPLATE = "\n\n[Hint from hindsight: {hint}]"


def hinted_messages(messages: list[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """A copy of `messages` whose last user turn ends with the hint (list-of-parts content handled); an empty
    hint leaves them as they are (the teacher then sees exactly the student's prompt)."""
    out = copy.deepcopy(messages)
    if not hint or not hint.strip():
        return out
    for msg in reversed(out):
        if msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, list):
                content.append({"type": "text", "text": HINT_TEMPLATE.format(hint=hint).lstrip("\n")})
            else:
                msg["content"] = (content or "") + HINT_TEMPLATE.format(hint=hint)
            return out
    return out + [{"role": "user", "content": HINT_TEMPLATE.format(hint=hint).strip()}]
