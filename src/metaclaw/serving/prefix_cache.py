"""Prefix reuse across a conversation's turns: the KV cache of what a model already read, kept for the next turn.

A chat client sends the whole conversation every turn, so turn k's prompt starts with turn k-1's prompt and reply
(and every prompt with the same system prompt and template header). `PrefixCache` keeps, per model (the base or
one adapter version), the keys and values of recently generated rows; `generate_batch` (`metaclaw.serving.
sampling`) looks up the longest cached prefix of each prompt, computes only the tokens after it, and stores the
row's prompt + reply back when it is done. One distribution: the cached keys and values are the ones the same
weights computed for the same tokens at the same positions, so a row's logits differ from a full prefill's only by
float rounding (the ratio-is-1 tests hold the behaviour logprobs to the trainer's within 1e-4).

Per tenant: an entry is found only by requests of the same tenant (the request's `cache_salt`, vLLM's field; the
proxy sets it per agent and client key), so how fast a prompt is answered never says what another tenant asked
(CVE-2025-46570). Bounded and fresh: at most `max_bytes` of tensors, least recently used first out; an adapter
version's entries go when the engine frees that version; an entry that another one extends is replaced by it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from metaclaw import profiling

#: one layer's (keys, values), each [heads, tokens, head_dim] (one row, no batch axis)
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Entry:
    ids: torch.Tensor  # [T] int64, the tokens whose keys and values `kv` holds
    kv: list[LayerKV]
    nbytes: int


def kv_bytes(kv: Sequence[LayerKV]) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def check_mb(mb: float) -> int:
    """The engines' `backend.prefix_cache_mb` (MiB; 0: no cache) in bytes; a value out of range is refused."""
    if not 0 <= float(mb) <= 2**20:
        raise ValueError(f"backend.prefix_cache_mb must be in [0, 1048576] MiB, got {mb!r}")
    return int(float(mb) * 2**20)


def from_mb(mb: float) -> PrefixCache | None:
    """`backend.prefix_cache_mb` as a cache, or None when off (0)."""
    size = check_mb(mb)
    return PrefixCache(size) if size else None


class PrefixCache:
    """LRU of per-row KV caches keyed by (model, tenant, token ids); thread-safe.

    Args:
        max_bytes: the most tensor bytes kept (0: nothing is kept; `lookup` always misses).
        min_tokens: shorter common prefixes are not worth a lookup's copy and are treated as misses.
    """

    def __init__(self, max_bytes: int, min_tokens: int = 8) -> None:
        if max_bytes < 0:
            raise ValueError(f"backend.prefix_cache_mb must be >= 0, got {max_bytes}")
        self.max_bytes, self.min_tokens = int(max_bytes), max(1, int(min_tokens))
        self._entries: OrderedDict[tuple[tuple[Hashable, Hashable], int], _Entry] = OrderedDict()
        self._ids = 0
        self._lock = threading.Lock()
        self.bytes = 0
        self.stats = {"lookups": 0, "hits": 0, "reused_tokens": 0, "prompt_tokens": 0, "stored": 0, "evicted": 0}

    def lookup(self, model: Hashable, ids: Sequence[int], limit: int, tenant: Hashable = None,
               ) -> tuple[int, list[LayerKV] | None]:  # fmt: skip
        """The longest cached prefix of `ids[:limit]` for `model` and `tenant`: (its length, the layers' keys and
        values cut to it, views that must not be written to); (0, None) when none reaches `min_tokens`."""
        model = (model, tenant)
        query = torch.as_tensor(list(ids[:limit]), dtype=torch.long)
        best, found = 0, None
        profiling.record("prefix_lookup", 0.0, 0.0, len(ids))  # prompts looked up, their tokens (cycle_profile)
        with self._lock:
            self.stats["lookups"] += 1
            self.stats["prompt_tokens"] += len(ids)
            for (owner, number), entry in self._entries.items():
                if owner != model:
                    continue
                n = min(len(entry.ids), len(query))
                if n <= best:
                    continue
                same = entry.ids[:n] == query[:n]
                common = n if bool(same.all()) else int(same.to(torch.int8).argmin())
                if common > best:
                    best, found = common, (owner, number)
            if found is None or best < self.min_tokens:
                return 0, None
            self._entries.move_to_end(found)
            entry = self._entries[found]
            self.stats["hits"] += 1
            self.stats["reused_tokens"] += best
            profiling.record("prefix_reused", 0.0, 0.0, best)  # prompt tokens not computed again (cycle_profile)
            return best, [(k[:, :best], v[:, :best]) for k, v in entry.kv]

    def store(self, model: Hashable, ids: Sequence[int], kv: list[LayerKV], tenant: Hashable = None) -> None:
        """Keep `kv` (the keys and values of `ids`, tensors this cache may keep) for `model` and `tenant`; entries
        it extends are dropped, and nothing is stored when an entry already extends it or it alone exceeds
        `max_bytes`."""
        model = (model, tenant)
        nbytes = kv_bytes(kv)
        if nbytes > self.max_bytes or len(ids) < self.min_tokens:
            return
        new = torch.as_tensor(list(ids), dtype=torch.long)
        with self._lock:
            for key, entry in list(self._entries.items()):
                if key[0] != model:
                    continue
                n = min(len(entry.ids), len(new))
                if not bool((entry.ids[:n] == new[:n]).all()):
                    continue
                if len(entry.ids) >= len(new):  # already held, or a longer turn of the same conversation
                    self._entries.move_to_end(key)
                    return
                self._drop(key)
            self._ids += 1
            self._entries[(model, self._ids)] = _Entry(new, kv, nbytes)
            self.bytes += nbytes
            self.stats["stored"] += 1
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.stats["evicted"] += 1

    def forget(self, model: Hashable) -> None:
        """Drop every entry of `model` (an adapter version the engine freed)."""
        with self._lock:
            for key in [k for k in self._entries if k[0][0] == model]:  # every tenant's
                self._drop(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _drop(self, key: tuple[tuple[Hashable, Hashable], int]) -> None:
        self.bytes -= self._entries.pop(key).nbytes
