"""The engine interface shared by the policy server and the remote training server.

An engine owns one base model and any number of named LoRA adapters. Every method is synchronous and
thread-safe: callers (the LitServe worker, the training server) run it in a worker thread. Adapter names are
re-pointable: `load_adapter("policy", ".../step-000042")` swaps the weights behind `policy` atomically; a request
keeps the version it resolved when it started, so nothing fails and nothing mixes versions during a swap.

Behaviour logprobs are each sampled token's logprob under the distribution it was drawn from: logits / temperature,
cut by top-k then top-p, renormalised (temperature 0 counts as 1, untruncated). `score_tokens` takes the same
three parameters, and the trainer recomputes with `metaclaw.distribution.logprobs.token_logprobs`: one distribution.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from metaclaw.serving.sampling import SamplingParams, SequenceOutput

__all__ = [
    "AdapterError",
    "Engine",
    "SamplingParams",
    "SequenceOutput",
    "TokenDelta",
    "TokenScore",
    "TokenStream",
    "UnknownAdapterError",
    "checked_params",
    "scores_from_rows",
    "scoring_ids",
]


class UnknownAdapterError(KeyError):
    """The requested adapter name is not loaded (the API answers 404 `model_not_found`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"the model {self.name!r} does not exist"


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded (missing files, pickle-only weights, incompatible shapes)."""


@dataclass(frozen=True)
class TokenDelta:
    """One sampled token and its behaviour logprob."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenScore:
    """The logprob of a given token and its rank (1 = most likely) in the next-token distribution."""

    logprob: float
    rank: int


class TokenStream(Iterator[TokenDelta]):
    """Iterator over the tokens of one sequence as they are sampled.

    Attributes:
        adapter_version: the adapter version serving this stream (None for the base model); known before the
            first token, so it can go into response headers.
        finish_reason: `stop` | `length`, set once the iterator is exhausted.
        output: the full `SequenceOutput` once exhausted (its token ids equal the streamed ones).
    """

    adapter_version: int | None = None
    finish_reason: str | None = None
    output: SequenceOutput | None = None

    def close(self) -> None:  # pragma: no cover - overridden where cancellation is possible
        """Stop generating early (the client went away); safe to call twice."""


def checked_params(prompt_ids: Sequence[int], params: SamplingParams, max_seq_len: int) -> SamplingParams:
    """`params` validated for this prompt, `max_tokens` cut to the room left in `max_seq_len` (most OpenAI servers'
    clients expect a reply that stops at the context, `length`, rather than an error)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    room = max_seq_len - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens; this model's context (model.max_seq_len) is {max_seq_len} tokens"
        )
    params.validate()
    if params.max_tokens > room:
        params = SamplingParams(**{**params.__dict__, "max_tokens": room})
    return params


def scoring_ids(prompt_ids: Sequence[int], target_ids: Sequence[int], max_seq_len: int) -> list[int]:
    """`prompt + target` for a teacher-forced score, checked: a prompt of one token at least, within `max_seq_len`."""
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    ids = [int(t) for t in prompt_ids] + [int(t) for t in target_ids]
    if len(ids) > max_seq_len:
        raise ValueError(f"prompt + target is {len(ids)} tokens; model.max_seq_len is {max_seq_len}")
    return ids


def scores_from_rows(
    rows: Sequence[dict[int, float]], targets: Sequence[int], ranks: Sequence[int], dist: tuple[float, float, int]
) -> list[TokenScore]:
    """Scores of `targets` under `dist` (`token_logprobs`: tempered, truncated, renormalised) from rows of raw
    logprobs (token id -> logprob; each row holds its target and the top-k, or the whole vocabulary)."""
    import torch

    from metaclaw.distribution.logprobs import token_logprobs

    width = max(len(row) for row in rows)
    logits = torch.full((len(rows), width), float("-inf"))
    for r, row in enumerate(rows):
        logits[r, : len(row)] = torch.tensor(list(row.values()))
    picked = torch.tensor([list(row).index(t) for row, t in zip(rows, targets, strict=True)])
    lps = token_logprobs(logits, picked, *dist).tolist()
    return [TokenScore(lp, rank) for lp, rank in zip(lps, ranks, strict=True)]


@runtime_checkable
class Engine(Protocol):
    """What the HTTP layers need from an inference engine (HF `generate` or vLLM).

    Attributes:
        model_name: the base model id served (the OpenAI `model` value that selects the base).
        tokenizer: the Hugging Face tokenizer (chat template, decoding).
        max_seq_len: longest prompt + completion accepted.
    """

    model_name: str
    tokenizer: Any
    max_seq_len: int

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> list[SequenceOutput]:
        """Sample `params.n` continuations; each output carries `adapter_version`.

        Raises:
            UnknownAdapterError: `adapter` is not loaded.
            ValueError: invalid params or a prompt that does not fit `max_seq_len`.
        """
        ...

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None) -> TokenStream:
        """Sample one continuation (`params.n` must be 1), yielding tokens as they are produced."""
        ...

    def score_tokens(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        adapter: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[TokenScore]:
        """Logprob and rank of each `target_ids[t]` after `prompt_ids + target_ids[:t]` (teacher-forced), under
        the tempered, truncated distribution of `metaclaw.distribution.logprobs.token_logprobs`; the rank is over the
        raw logits."""
        ...

    def prompt_logprobs(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        adapter: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[float]:
        """`[len(target_ids)]` logprobs of the target tokens (teacher logprobs); see `score_tokens`."""
        ...

    def load_adapter(self, name: str, path: str, version: int | None = None) -> int:
        """Load (or re-point) `name` to the PEFT adapter in `path` (safetensors only); returns its new version
        (`version` when given and newer: `AdapterRegistry.next_version`)."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Forget `name`; requests already running on it finish first. Raises UnknownAdapterError."""
        ...

    def adapters(self) -> dict[str, int]:
        """Loaded adapter names and their current versions."""
        ...

    def adapter_version(self, name: str | None) -> int | None:
        """The current version of `name` (None for the base). Raises UnknownAdapterError."""
        ...

    def close(self) -> None:
        """Release the model and worker threads."""
        ...
