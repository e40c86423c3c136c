"""OPD teacher logprobs: the log-prob of each original response token under prompt + hint, from any server that
offers vLLM's `/v1/completions` with token-id prompts and `prompt_logprobs` (ours or an external vLLM)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from metaclaw.datamodules.seed import render_prompt
from metaclaw.datamodules.store import Sample
from metaclaw.scoring.hints import hinted_messages
from metaclaw.serving.client import teacher_logprobs


class TeacherClient:
    """Teacher logprobs over HTTP.

    Args:
        base_url: server base URL (no `/v1`).
        model: the teacher's model name (our base model, adapter disabled, or an external model).
        api_key: bearer key.
        timeout_s: per request.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        self.base_url, self.model, self.api_key, self.timeout_s = base_url.rstrip("/"), model, api_key, timeout_s

    async def logprobs(self, prompt_ids: Sequence[int], target_ids: Sequence[int]) -> list[float]:
        """Teacher logprob of each target token (the policy server's client helper, run in a thread)."""
        return await asyncio.to_thread(
            teacher_logprobs, self.base_url, self.model, prompt_ids, target_ids, self.api_key, self.timeout_s
        )


def hinted_prompt_ids(tokenizer: Any, sample: Sample, hint: str) -> list[int]:
    """The teacher's prompt: the sample's messages with the hint, through the chat template (tools kept)."""
    messages = hinted_messages(sample.messages or [], hint)
    tools = sample.meta.get("tools")
    if tools:
        out = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(out)
    return render_prompt(tokenizer, messages)


PromptRenderer = Callable[[Sample, str], list[int]]
