"""Client helpers for the policy server that work the same against a real vLLM OpenAI server."""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from metaclaw.distribution import Dist
from metaclaw.wire import bearer_headers


def _v1(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else f"{base}/v1"


def load_adapter(
    base_url: str,
    lora_name: str,
    lora_path: str,
    api_key: str | None = None,
    timeout: float = 60.0,
    version: int | None = None,
) -> httpx.Response:
    """vLLM's `POST /v1/load_lora_adapter` `{lora_name, lora_path}` (with metaclaw's `adapter_version` when the
    caller knows the version it publishes); the response, for the caller to judge."""
    body: dict[str, object] = {"lora_name": lora_name, "lora_path": lora_path}
    if version is not None:
        body["adapter_version"] = int(version)
    return httpx.post(f"{_v1(base_url)}/load_lora_adapter", json=body, headers=bearer_headers(api_key), timeout=timeout)


def teacher_logprobs(
    base_url: str,
    model: str,
    prompt_ids: Sequence[int],
    target_ids: Sequence[int],
    api_key: str | None = None,
    timeout: float = 120.0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    user: str | None = None,
) -> list[float]:
    """Logprob of each `target_ids[t]` after `prompt_ids + target_ids[:t]` under `model` (base or adapter name),
    over the distribution `(temperature, top_p, top_k)` the student's tokens were sampled from.

    Sends the request form both servers accept: `POST /v1/completions` with the token ids as `prompt`,
    `max_tokens: 0` (OpenAI's and vLLM's echo without generation: the server samples nothing, so a score is one
    forward, not a forward plus a one-token generation over the same tokens), `echo: true`, `logprobs: 0` and
    vLLM's `prompt_logprobs: 0`; reads `choices[0].prompt_logprobs` (vLLM's shape: one `{token_id: {logprob,
    rank, decoded_token}}` per prompt token, the first null), falling back to `choices[0].logprobs.
    token_logprobs` (OpenAI's echo shape). Prompt logprobs are raw on vLLM; for any other distribution the
    request adds `logprobs_mode: processed_logprobs` with the sampling fields, which the metaclaw policy server
    honours and echoes in the choice.

    Raises:
        httpx.HTTPStatusError: the server refused the request (unknown model, too long, ...).
        ValueError: the response holds neither field, or the server cannot score under that distribution.
    """
    prompt, target = [int(t) for t in prompt_ids], [int(t) for t in target_ids]
    if not prompt:
        raise ValueError("prompt_ids must hold at least one token")
    if not target:
        return []
    dist = Dist.of(temperature, top_p, top_k)
    raw = dist == Dist()
    headers = bearer_headers(api_key)
    body = {
        "model": model,
        "prompt": prompt + target,
        "max_tokens": 0,
        "temperature": dist.temperature,
        "echo": True,
        "logprobs": 0,
        "prompt_logprobs": 0,
    }
    if user is not None:  # OpenAI's end-user field: the policy server tags its work with it (metaclaw.profiling)
        body["user"] = user
    if not raw:
        body.update(top_p=dist.top_p, top_k=dist.top_k, logprobs_mode="processed_logprobs")
    response = httpx.post(f"{_v1(base_url)}/completions", json=body, headers=headers, timeout=timeout)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    if not raw and choice.get("logprobs_mode") != "processed_logprobs":
        raise ValueError(
            f"the teacher server at {base_url} returns raw prompt logprobs only; it cannot score the response under "
            f"temperature={dist.temperature}, top_p={dist.top_p}, top_k={dist.top_k} (the sampling distribution). "
            "Point the teacher at a metaclaw policy server, or sample at temperature 1 without top-p/top-k."
        )
    entries = choice.get("prompt_logprobs")
    if entries:
        return [float(entry[str(tok)]["logprob"]) for entry, tok in zip(entries[len(prompt) :], target, strict=True)]
    legacy = (choice.get("logprobs") or {}).get("token_logprobs")
    if legacy and raw:
        return [float(x) for x in legacy[len(prompt) : len(prompt) + len(target)]]
    raise ValueError("the response has neither choices[0].prompt_logprobs nor choices[0].logprobs.token_logprobs")
