"""The distribution a token was drawn from, as recorded on every sample (torch-free: the proxy imports it).

A sample's behaviour logprobs, the trainer's logprobs and the teacher's logprobs are all over one distribution:
`softmax(logits / temperature)` cut by top-k then top-p and renormalised (`metaclaw.serving.sampling.
token_logprobs`). Greedy decoding (temperature 0) is scored as temperature 1, untruncated.
"""

from __future__ import annotations

from typing import Any

UNTRUNCATED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


def distribution(temperature: float, top_p: float = 1.0, top_k: int = -1) -> tuple[float, float, int]:
    """`(temperature, top_p, top_k)` logprobs are over: greedy is `(1, 1, -1)`; `top_k` 0 (off) becomes -1."""
    if temperature <= 0:
        return 1.0, 1.0, -1
    return float(temperature), float(top_p), int(top_k) if top_k > 0 else -1


def sample_distribution(temperature: float, meta: dict[str, Any] | None) -> dict[str, Any]:
    """A stored sample's distribution: its `temperature` column with `meta["sampling"]`'s top-p/top-k."""
    recorded = (meta or {}).get("sampling") or {}
    t, p, k = distribution(temperature, recorded.get("top_p", 1.0), recorded.get("top_k", -1))
    return {"temperature": t, "top_p": p, "top_k": k}
