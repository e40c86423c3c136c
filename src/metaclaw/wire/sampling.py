"""The sampling vocabulary every server shares: what a request may set (`SamplingParams`), what a sampler returns
(`SequenceOutput`), and the one builder that turns any request's sampling fields into checked `SamplingParams`
(`sampling_params`: the policy server's chat and completions routes, the training server's sample and chat
routes and the Tinker API's `asample`). Light: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from metaclaw.distribution import Dist, temperature_or_greedy, top_k_or_off
from metaclaw.wire import RequestError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on `top_logprobs`


@dataclass
class SamplingParams:
    """What a request may set; validated by `validate()` (raises ValueError naming the field)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None  # the prefix-cache tenant (vLLM's field): prefixes are reused only within it
    top_logprobs: int = 0  # the most likely tokens reported at each sampled position (OpenAI's field; 0 to 20)

    def __post_init__(self) -> None:
        self.top_k = top_k_or_off(self.top_k)
        self.temperature = temperature_or_greedy(self.temperature)  # every engine and `Dist.of` see one greedy

    def validate(self, allow_zero: bool = False) -> None:
        """Raise ValueError naming the field; `allow_zero`: `max_tokens` 0 (a prompt scored, nothing sampled)."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < (0 if allow_zero else 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 16:
            raise ValueError(f"n must be an integer in [1, 16], got {self.n!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")

    def distribution(self) -> Dist:
        """The distribution the logprobs are over (`Dist.of`: greedy is `Dist()`)."""
        return Dist.of(self.temperature, self.top_p, self.top_k)


@dataclass
class SequenceOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos or stop string) | "length"
    adapter_version: int | None = None  # set by engines: which adapter version sampled it (None: base)
    # at each sampled position, the `top_logprobs` most likely tokens `(id, logprob)` of the distribution it was
    # drawn from, most likely first (None: not asked)
    top_logprobs: list[list[tuple[int, float]]] | None = None


def sampling_params(
    n: int = 1, stop: str | Sequence[str | int] | None = None, *, max_n: int = 16, n_field: str = "n",
    allow_zero: bool = False, **fields: Any,
) -> SamplingParams:  # fmt: skip
    """Checked `SamplingParams` of a request: `n` samples (at most `max_n`, named `n_field` in errors), `stop` one
    string or a list of strings and token ids (empty strings dropped: they would stop everywhere), and the other
    `SamplingParams` fields; `allow_zero`: `max_tokens` may be 0.

    Raises:
        RequestError: 400 naming the field.
    """
    if n > max_n:
        raise RequestError(f"{n_field} must be at most {max_n}, got {n}", param=n_field)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stops = [x for x in stops if x != ""]
    params = SamplingParams(n=n, stop=[x for x in stops if isinstance(x, str)],
                            stop_token_ids=[x for x in stops if isinstance(x, int)], **fields)  # fmt: skip
    try:
        params.validate(allow_zero)
    except ValueError as exc:
        raise RequestError(str(exc), param=str(exc).split(" ", 1)[0]) from exc
    return params
