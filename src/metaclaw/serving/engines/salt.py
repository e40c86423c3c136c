"""The prefix-cache tenant on vLLM (issue 43): vLLM keys cached prompt blocks by the request's `cache_salt`, its
answer to CVE-2025-46570 (a request that can reuse another tenant's cached prefix can time it, and so learn it).

The policy server reads `cache_salt` from each request (`metaclaw.serving.protocol`; the proxy sets one per agent and
client key, `SamplingParams.cache_salt`), and the HF engine keys its own prefix cache by it. `salted` puts it where
vLLM reads it: the `TokensPrompt` the in-process engine submits, or the JSON body of a request to a `vllm serve`
process (both name the field `cache_salt`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def salted(prompt: Mapping[str, Any], cache_salt: str | None) -> dict[str, Any]:
    """`prompt` (a vLLM `TokensPrompt` dict, or an OpenAI-style request body for `vllm serve`) with `cache_salt` set
    when the request has a tenant; without one, unchanged (the cache shared by every request without a salt)."""
    out = dict(prompt)
    if cache_salt is None:
        return out
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
    out["cache_salt"] = cache_salt
    return out
