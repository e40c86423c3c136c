"""The one prompt renderer: messages (+ tools, + `chat_template_kwargs`) → prompt token ids, as the policy server
renders them. The server, the seed filler, the OPD teacher's prompt and the proxy's context fit all call it, so
behaviour, training and teacher logprobs are taken over the same prompt. Light: no torch, no engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The chat template applied with the generation prompt, tokenised; template errors propagate."""
    ids = tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=True,
        **dict(template_kwargs or {}),
    )  # fmt: skip
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
