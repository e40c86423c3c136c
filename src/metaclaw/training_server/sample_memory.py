"""Which distribution sampled each recent sequence of a session: the training server's distribution rule.

`/v1/sample` reports each sampled token's logprob under the request's `Dist` (`metaclaw.distribution`) and
remembers which `Dist` sampled each sequence; `/v1/train/forward_backward` recomputes the logprobs under the same
`Dist` (`dist_logprobs`), so the importance ratio of on-policy data is exactly 1 whatever the client sends as
`temperature`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from metaclaw.distribution import Dist


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
