"""One distribution for sampling and training: tempered, top-k/top-p truncated, renormalised softmax.

`/v1/sample` reports each sampled token's logprob under `Dist(temperature, top_p, top_k)` computed by
`processed_logprobs` on the training model (with the session's published adapter), and remembers which `Dist`
sampled each sequence; `/v1/train/forward_backward` recomputes the same function with the same `Dist`, so the
importance ratio of on-policy data is exactly 1 whatever the client sends as `temperature`.

The kept set of a position is the top-k tokens, then the smallest prefix of those (by probability) whose mass
reaches top_p, plus the target token itself (a sampled token is always in the support, so numerical jitter at
the nucleus boundary can never give −inf).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from metaclaw.serving.sampling import SamplingParams

_CHUNK = 256  # positions per truncation-mask block (bounds the [chunk, V] sort buffers)


@dataclass(frozen=True)
class Dist:
    """The distribution a token was sampled from (greedy sampling is reported under T=1, untruncated)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def of(cls, params: SamplingParams) -> Dist:
        if params.temperature == 0:
            return cls()
        top_k = params.top_k if params.top_k and params.top_k > 0 else -1
        return cls(float(params.temperature), float(params.top_p), int(top_k))

    @property
    def truncated(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


def _keep_mask(scaled: Tensor, targets: Tensor, dist: Dist) -> Tensor:
    """`[T, V]` bool: the tokens each position may sample under `dist` (target always kept)."""
    keep = torch.ones_like(scaled, dtype=torch.bool)
    vocab = scaled.shape[-1]
    if dist.top_k > 0 and dist.top_k < vocab:
        kth = torch.topk(scaled, dist.top_k, dim=-1).values[..., -1:]
        keep &= scaled >= kth
    if dist.top_p < 1.0:
        masked = scaled.masked_fill(~keep, float("-inf"))
        probs, order = torch.sort(masked.softmax(-1), dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass strictly before each token in the sorted order
        sorted_keep = before < dist.top_p
        keep = torch.zeros_like(keep).scatter(-1, order, sorted_keep) & keep
    keep.scatter_(-1, targets.unsqueeze(-1), True)
    return keep


def processed_logprobs(logits: Tensor, targets: Tensor, dists: Sequence[Dist]) -> Tensor:
    """`[B, T, V]` logits, `[B, T]` targets, one `Dist` per row → `[B, T]` logprobs (grad flows through logits)."""
    rows = []
    for b, dist in enumerate(dists):
        scaled = logits[b].float() / dist.temperature
        if dist.truncated:
            with torch.no_grad():
                keep = torch.cat(
                    [
                        _keep_mask(scaled[i : i + _CHUNK].detach(), targets[b, i : i + _CHUNK], dist)
                        for i in range(0, scaled.shape[0], _CHUNK)
                    ]
                )
            scaled = scaled.masked_fill(~keep, float("-inf"))
        rows.append(torch.gather(scaled.log_softmax(-1), -1, targets[b].unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def sequence_key(tokens: Sequence[int]) -> bytes:
    """A compact key of a whole token sequence (prompt + completion)."""
    return hashlib.blake2b(",".join(map(str, tokens)).encode(), digest_size=16).digest()


class SampleMemory:
    """Which `Dist` sampled each recent sequence of a session (bounded LRU; the oldest entries are dropped).

    Args:
        capacity: sequences remembered.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self._entries: OrderedDict[bytes, Dist] = OrderedDict()
        self.last: Dist | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, tokens: Sequence[int], dist: Dist) -> None:
        self.last = dist
        if not self.capacity:
            return
        key = sequence_key(tokens)
        self._entries[key] = dist
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def lookup(self, tokens: Sequence[int]) -> Dist | None:
        return self._entries.get(sequence_key(tokens))
