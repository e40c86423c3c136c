"""OPD teacher logprobs: the log-prob of each original response token under prompt + hint, from any server that
offers vLLM's `/v1/completions` with token-id prompts and `prompt_logprobs` (ours or an external vLLM)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from metaclaw.scoring.hints import hinted_messages
from metaclaw.store import Sample
from metaclaw.wire.client import Endpoint, teacher_logprobs
from metaclaw.wire.render import chat_prompt_ids


class TeacherClient:
    """Teacher logprobs over HTTP.

    Args:
        base_url: server base URL (with or without `/v1`).
        model: the teacher's model name (our base model, adapter disabled, or an external model).
        api_key: bearer key.
        timeout_s: per request.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        self.endpoint, self.model, self.timeout_s = Endpoint(base_url, api_key), model, timeout_s

    async def logprobs(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[float]:
        """Teacher logprob of each target token under the student's sampling distribution (pass the sample's
        `sample_distribution`), so OPD's `teacher - behaviour` compares like with like."""
        return await asyncio.to_thread(
            teacher_logprobs, self.endpoint, self.model, prompt_ids, target_ids, self.timeout_s, temperature, top_p,
            top_k,
        )  # fmt: skip


def hinted_prompt_ids(tokenizer: Any, sample: Sample, hint: str) -> list[int]:
    """The teacher's prompt: the sample's messages plus the hint, rendered as the server rendered the student's
    (same tools, same `chat_template_kwargs`, generation prompt). An empty hint gives the student's prompt."""
    messages = hinted_messages(sample.text.messages or [], hint)
    return chat_prompt_ids(tokenizer, messages, sample.meta.tools, sample.meta.chat_template_kwargs)
