"""The sampling distribution: the one rule every part that samples or scores a token follows (ground floor).

A token is drawn from `softmax(logits / temperature)` cut by top-k then top-p and renormalised. Its behaviour
logprob (the policy server, the training server), its training logprob (the trainer, the training server) and its
teacher logprob are all taken under that same distribution (`metaclaw.distribution.logprobs.token_logprobs`), so
the on-policy importance ratio is 1. Two conventions hold everywhere:

- greedy decoding (temperature 0) is scored as temperature 1, untruncated;
- `top_k` off is spelled -1 (vLLM and Tinker also accept 0 for off: `top_k_or_off`).

This module is torch-free (the proxy records a turn's distribution with it); the maths is in `logprobs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

TOP_K_OFF = -1


GREEDY_BELOW = 1e-5
"""A temperature under this is greedy (vLLM's `_SAMPLING_EPS`): dividing logits by 1e-308 overflows float32."""


def temperature_or_greedy(temperature: Any) -> Any:
    """A request's temperature in our spelling: one in `[0, GREEDY_BELOW)` becomes 0 (greedy); any other value is
    kept for the request's own validation to judge."""
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and 0 <= temperature < GREEDY_BELOW:
        return 0.0
    return temperature


def top_k_or_off(top_k: int | None) -> int:
    """A request's `top_k` in our spelling: None and 0 (off in vLLM's and Tinker's spelling) become -1; any other
    value is kept for the request's own validation to judge."""
    return TOP_K_OFF if top_k is None or top_k == 0 else top_k


class Dist(NamedTuple):
    """The distribution a token was drawn from: `(temperature, top_p, top_k)`; the default is untruncated T=1."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_OFF

    @classmethod
    def of(cls, temperature: float, top_p: float | None = 1.0, top_k: int | None = TOP_K_OFF) -> Dist:
        """The distribution logprobs are over for these sampling settings: greedy is `Dist()`; a `top_k` that is
        not positive is off (-1); a missing `top_p` is 1."""
        if temperature < GREEDY_BELOW:
            return cls()
        k = int(top_k) if top_k is not None and top_k > 0 else TOP_K_OFF
        return cls(float(temperature), 1.0 if top_p is None else float(top_p), k)

    @property
    def truncated(self) -> bool:
        """Whether top-p or top-k cuts the vocabulary (not whether it does so for a given vocabulary size)."""
        return self.top_p < 1.0 or self.top_k > 0


def sample_distribution(temperature: float, meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """A stored sample's distribution: its `temperature` column with `meta["sampling"]`'s top-p/top-k."""
    recorded = (meta or {}).get("sampling") or {}
    return Dist.of(temperature, recorded.get("top_p", 1.0), recorded.get("top_k", TOP_K_OFF))._asdict()
