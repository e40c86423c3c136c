"""Client helpers for the policy server that work the same against a real vLLM OpenAI server."""

from __future__ import annotations

from collections.abc import Sequence

import httpx


def _v1(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else f"{base}/v1"


def teacher_logprobs(
    base_url: str,
    model: str,
    prompt_ids: Sequence[int],
    target_ids: Sequence[int],
    api_key: str | None = None,
    timeout: float = 120.0,
) -> list[float]:
    """Logprob of each `target_ids[t]` after `prompt_ids + target_ids[:t]` under `model` (base or adapter name).

    Sends the request form both servers accept: `POST /v1/completions` with the token ids as `prompt`,
    `max_tokens: 1`, `temperature: 1.0`, `echo: true`, `logprobs: 0` and vLLM's `prompt_logprobs: 0`; reads
    `choices[0].prompt_logprobs` (vLLM's shape: one `{token_id: {logprob, rank, decoded_token}}` per prompt
    token, the first null), falling back to `choices[0].logprobs.token_logprobs` (OpenAI's echo shape).

    Raises:
        httpx.HTTPStatusError: the server refused the request (unknown model, too long, ...).
        ValueError: the response holds neither field.
    """
    prompt, target = [int(t) for t in prompt_ids], [int(t) for t in target_ids]
    if not prompt:
        raise ValueError("prompt_ids must hold at least one token")
    if not target:
        return []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "model": model,
        "prompt": prompt + target,
        "max_tokens": 1,
        "temperature": 1.0,
        "echo": True,
        "logprobs": 0,
        "prompt_logprobs": 0,
    }
    response = httpx.post(f"{_v1(base_url)}/completions", json=body, headers=headers, timeout=timeout)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    entries = choice.get("prompt_logprobs")
    if entries:
        return [float(entry[str(tok)]["logprob"]) for entry, tok in zip(entries[len(prompt) :], target, strict=True)]
    legacy = (choice.get("logprobs") or {}).get("token_logprobs")
    if legacy:
        return [float(x) for x in legacy[len(prompt) : len(prompt) + len(target)]]
    raise ValueError("the response has neither choices[0].prompt_logprobs nor choices[0].logprobs.token_logprobs")
