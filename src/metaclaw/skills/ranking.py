"""Rankers that order skills by relevance to a query, and score how similar a text is to existing skills.

`BM25Ranker` needs nothing beyond the standard library; `EmbeddingRanker` (in `embedding.py`) uses the
offline all-MiniLM-L6-v2 model. Both satisfy `SkillRanker`, the plug point `SkillInjector` and `SkillEvolver`
take (build either with Hydra `_target_`).
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from metaclaw.skills.skill import Skill

_TOKEN_RE = re.compile(r"[a-z0-9]+")
_STOPWORD_TEXT = """a an and are as at be been but by can could did do does doing for from had has have how i if in
    into is it
    its just me my no not of on or our so than that the their them then there these they this to too us was we
    were what when where which who why will with would you your yours please hi hello hey thanks thank ok okay
    let lets can't i'm it's also any some all about up out get got"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())
_SUFFIXES = (
    "ational",
    "ization",
    "fulness",
    "iveness",
    "ations",
    "ation",
    "ments",
    "ment",
    "ness",
    "ings",
    "ing",
    "ies",
    "ied",
    "ers",
    "er",
    "ed",
    "ly",
    "es",
    "s",
)


def stem(token: str) -> str:
    """A light suffix stripper (not Porter): maps `failing`/`failed`/`fails` to `fail`."""
    for suffix in _SUFFIXES:
        if token.endswith(suffix) and len(token) - len(suffix) >= 3:
            token = token[: -len(suffix)]
            if suffix in ("ies", "ied"):
                token += "y"
            break
    if len(token) > 3 and token[-1] == token[-2] and token[-1] not in "ls":
        token = token[:-1]  # "stopp" -> "stop", "runn" -> "run"
    return token


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens, stopwords removed, lightly stemmed."""
    return [stem(t) for t in _TOKEN_RE.findall(text.lower()) if t not in STOPWORDS and len(t) > 1]


@dataclass(frozen=True)
class _Index:
    tfs: list[Counter[str]]
    lens: list[int]
    idf: dict[str, float]
    avg_len: float


@runtime_checkable
class SkillRanker(Protocol):
    """Orders skills for a query and measures similarity for duplicate detection."""

    #: similarity at or above which a proposed skill counts as a duplicate of an existing one
    duplicate_threshold: float

    def rank(self, query: str, skills: Sequence[Skill], top_k: int) -> list[tuple[Skill, float]]:
        """Return up to `top_k` (skill, score) pairs with score > 0, best first."""
        ...

    def similarity(self, text: str, skills: Sequence[Skill]) -> list[float]:
        """Similarity in [0, 1] of `text` to each skill's `search_text`, in the order given."""
        ...


class BM25Ranker:
    """Okapi BM25 over each skill's name, description, category and body; no extra dependencies.

    Name and description carry the gist of a skill, so they are repeated `field_boost` times in the indexed
    document. The index is rebuilt only when the set of skills (by content hash) changes.

    Args:
        k1: term-frequency saturation.
        b: document-length normalisation.
        field_boost: how many times name and description are counted.
        min_score: skills scoring at or below this are not returned by `rank`.
        duplicate_threshold: idf-weighted cosine at or above which a text duplicates a skill (distinct starter
            skills score at most ~0.17 against each other; a paraphrased copy ~0.45).
    """

    def __init__(
        self,
        k1: float = 1.2,
        b: float = 0.75,
        field_boost: int = 2,
        min_score: float = 0.0,
        duplicate_threshold: float = 0.35,
    ) -> None:
        self.k1, self.b, self.field_boost, self.min_score = k1, b, field_boost, min_score
        self.max_cached_indexes = 64
        self.duplicate_threshold = duplicate_threshold
        self._lock = threading.Lock()
        self._indexes: OrderedDict[tuple[str, ...], _Index] = OrderedDict()  # one per skill set (i.e. per agent)

    def _doc_tokens(self, skill: Skill) -> list[str]:
        head = tokenize(f"{skill.name.replace('-', ' ').replace('_', ' ')} {skill.description}")
        return head * self.field_boost + tokenize(f"{skill.category} {skill.body}")

    def _index(self, skills: Sequence[Skill]) -> _Index:
        key = tuple(s.content_hash for s in skills)
        with self._lock:
            index = self._indexes.get(key)
            if index is not None:
                self._indexes.move_to_end(key)
                return index
        tfs = [Counter(self._doc_tokens(s)) for s in skills]
        df: Counter[str] = Counter()
        for tf in tfs:
            df.update(tf.keys())
        n = len(tfs)
        lens = [sum(tf.values()) for tf in tfs]
        index = _Index(
            tfs=tfs,
            lens=lens,
            idf={t: math.log(1.0 + (n - d + 0.5) / (d + 0.5)) for t, d in df.items()},
            avg_len=(sum(lens) / n) if n else 1.0,
        )
        with self._lock:
            self._indexes[key] = index
            while len(self._indexes) > self.max_cached_indexes:
                self._indexes.popitem(last=False)
        return index

    def scores(self, query: str, skills: Sequence[Skill]) -> list[float]:
        """BM25 score of `query` against every skill, in the order given."""
        index = self._index(skills)
        terms = Counter(tokenize(query))
        out = []
        for tf, length in zip(index.tfs, index.lens, strict=True):
            score = 0.0
            norm = self.k1 * (1 - self.b + self.b * length / index.avg_len)
            for term, qtf in terms.items():
                f = tf.get(term)
                if f:
                    score += qtf * index.idf[term] * f * (self.k1 + 1) / (f + norm)
            out.append(score)
        return out

    def rank(self, query: str, skills: Sequence[Skill], top_k: int) -> list[tuple[Skill, float]]:
        """Up to `top_k` skills with a BM25 score above `min_score` (and > 0), best first (ties broken by name)."""
        if not skills or top_k <= 0:
            return []
        floor = max(0.0, self.min_score)
        scored = [(s, sc) for s, sc in zip(skills, self.scores(query, skills), strict=True) if sc > floor]
        scored.sort(key=lambda pair: (-pair[1], pair[0].name))
        return scored[:top_k]

    def similarity(self, text: str, skills: Sequence[Skill]) -> list[float]:
        """Cosine of idf-weighted term vectors (idf over the skills plus `text`)."""
        docs = [Counter(tokenize(s.search_text)) for s in skills]
        probe = Counter(tokenize(text))
        n = len(docs) + 1
        df: Counter[str] = Counter(probe.keys())
        for d in docs:
            df.update(d.keys())
        idf = {t: math.log(1.0 + n / c) for t, c in df.items()}

        def vec(tf: Counter[str]) -> dict[str, float]:
            return {t: (1 + math.log(f)) * idf[t] for t, f in tf.items()}

        pv = vec(probe)
        pn = math.sqrt(sum(v * v for v in pv.values())) or 1.0
        out = []
        for d in docs:
            dv = vec(d)
            dn = math.sqrt(sum(v * v for v in dv.values())) or 1.0
            out.append(sum(w * dv.get(t, 0.0) for t, w in pv.items()) / (pn * dn))
        return out
