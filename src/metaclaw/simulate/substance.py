"""Does a reply answer the question it was asked? What a simulated person checks beside the form (issue 42).

People react to content as well as form: a three-sentence reply about something else is not "short and sweet",
it is not an answer. Session 28's `concise` run learnt exactly that loophole ("A moon cup is in her cup" passed a
sentence count and was praised), because its people reacted only to form.

The check is a retrieval test, so it needs no similarity threshold tuned to any kind or wording: the reply is
embedded with a sentence encoder the caller gives (the benches give the offline all-MiniLM-L6-v2 of
`metaclaw.skills.embedding`; simulate sits beside skills and does not import it), and it answers its question when
that question is among the `top` questions of the people's pool most similar to it. A reply on the question's
topic finds its question; a reply about something else finds it only by chance. `top` was set from the base
model's own replies to the people's questions (`bench/studies/substance.py`). What the reply says is not checked
for truth: a person who does not know the answer cannot either.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Encoder(Protocol):
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised embeddings, one row per text."""
        ...


class Substance:
    """`answers(question, reply)`: is the reply about its question rather than about the pool's other questions?

    Args:
        questions: the people's own questions; each reply is compared with its question and every other one.
        encoder: sentence embeddings (the benches: `metaclaw.skills.embedding.EmbeddingRanker`).
        top: the reply answers when at most `top - 1` other questions are more similar to it than its own
            (a reply about nothing in particular passes by chance about `top / len(questions)` of the time).
    """

    def __init__(self, questions: Sequence[str], encoder: Encoder, top: int = 5) -> None:
        self.pool = list(dict.fromkeys(q for q in questions if q))
        if not 1 <= top < len(self.pool):
            raise ValueError(f"substance: need 1 <= top < {len(self.pool)} (the questions), got top={top}")
        self.top = top
        self.encoder = encoder
        self._pool_vectors: np.ndarray | None = None
        self._lock = threading.Lock()

    def ranks(self, questions: Sequence[str], replies: Sequence[str]) -> list[int]:
        """For each reply, how many of the pool's other questions it is more similar to than to its own (0: its
        own first). A question outside the pool is compared with the whole pool."""
        with self._lock:
            if self._pool_vectors is None:
                self._pool_vectors = self.encoder.encode(self.pool)
        pool = self._pool_vectors
        index = {q: i for i, q in enumerate(self.pool)}
        outside = [q for q in dict.fromkeys(questions) if q not in index]
        extra = dict(zip(outside, self.encoder.encode(outside), strict=True)) if outside else {}
        own = [pool[index[q]] if q in index else extra[q] for q in questions]  # the pool's questions: encoded once
        reps = self.encoder.encode(list(replies))
        out = []
        for q, o, r in zip(questions, own, reps, strict=True):
            sims = pool @ r
            mine = float(o @ r)
            out.append(sum(float(s) > mine for s, p in zip(sims, self.pool, strict=True) if p != q))
        return out

    def answers(self, question: str, reply: str) -> bool:
        """True when the reply is about `question`; an empty reply never is."""
        if not reply.strip():
            return False
        return self.ranks([question], [reply])[0] < self.top
