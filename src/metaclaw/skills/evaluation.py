"""Retrieval quality on a labelled query set against the starter bank (used by tests and `bench/`)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from metaclaw.skills.query import extract_query
from metaclaw.skills.ranking import SkillRanker
from metaclaw.skills.skill import Skill


@dataclass(frozen=True)
class RetrievalCase:
    """A user message (possibly wrapped in client boilerplate) and the skills relevant to it."""

    query: str
    relevant: tuple[str, ...]
    wrapped: bool = False


def load_retrieval_cases() -> list[RetrievalCase]:
    """The labelled queries shipped in `metaclaw/skills/eval/retrieval_queries.jsonl`."""
    text = (resources.files("metaclaw.skills") / "eval" / "retrieval_queries.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [RetrievalCase(r["query"], tuple(r["relevant"]), bool(r.get("wrapped"))) for r in rows]


def evaluate_ranker(
    ranker: SkillRanker, skills: Sequence[Skill], cases: Sequence[RetrievalCase], k: int = 3
) -> dict[str, Any]:
    """Precision@k, hit@k (any relevant skill in the top k), MRR and median latency (query extraction + ranking).

    Precision@k is |relevant ∩ top-k| / k, so a query with one relevant skill scores at most 1/k.
    """
    precisions, hits, rrs, latencies = [], [], [], []
    per_query = []
    for case in cases:
        start = time.perf_counter()
        query = extract_query([{"role": "user", "content": case.query}])
        ranked = [s.name for s, _ in ranker.rank(query, skills, len(skills))]
        latencies.append((time.perf_counter() - start) * 1000)
        top = ranked[:k]
        rel = set(case.relevant)
        precisions.append(len(rel.intersection(top)) / k)
        hits.append(1.0 if rel.intersection(top) else 0.0)
        rank = next((i + 1 for i, n in enumerate(ranked) if n in rel), None)
        rrs.append(1.0 / rank if rank else 0.0)
        per_query.append({"query": query[:80], "top": top, "relevant": list(case.relevant)})
    best = [min(len(c.relevant), k) / k for c in cases]
    return {
        f"precision_at_{k}": statistics.fmean(precisions),
        f"max_precision_at_{k}": statistics.fmean(best),
        f"hit_at_{k}": statistics.fmean(hits),
        "mrr": statistics.fmean(rrs),
        "median_latency_ms": statistics.median(latencies),
        "queries": len(cases),
        "per_query": per_query,
    }
