"""Skill retrieval benchmark: precision@3 and median latency of the BM25 and embedding rankers.

Runs the labelled queries shipped in `metaclaw/skills/eval/retrieval_queries.jsonl` against the starter bank and
prints JSON. Latency covers query extraction (boilerplate stripping) plus ranking, with skill vectors already
cached (the first embedding call, which loads the model and embeds the bank, is reported separately).

    python bench/studies/skills_retrieval.py [--k 3] [--repeats 5] [--per-query]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from metaclaw.skills import BM25Ranker, EmbeddingRanker, SkillLibrary  # noqa: E402
from metaclaw.skills.evaluation import evaluate_ranker, load_retrieval_cases  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="passes over the query set for latency")
    parser.add_argument("--per-query", action="store_true", help="include each query's top-k")
    add_results_argument(parser)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        skills = SkillLibrary(os.path.join(tmp, "skills")).skills()
        cases = load_retrieval_cases()
        embedding = EmbeddingRanker(cache_dir=os.path.join(tmp, "cache"))
        start = time.perf_counter()
        embedding.skill_vectors(skills)
        cold_s = time.perf_counter() - start
        report: dict[str, object] = {"skills": len(skills), "queries": len(cases), "k": args.k}
        for name, ranker in (("bm25", BM25Ranker()), ("embedding", embedding)):
            runs = [evaluate_ranker(ranker, skills, cases, args.k) for _ in range(args.repeats)]
            first = runs[0]
            entry = {
                key: round(val, 4) if isinstance(val, float) else val
                for key, val in first.items()
                if key not in ("per_query", "queries", "median_latency_ms")
            }
            entry["median_latency_ms"] = round(statistics.median(r["median_latency_ms"] for r in runs), 3)
            if args.per_query:
                entry["per_query"] = first["per_query"]
            report[name] = entry
        report["embedding"]["cold_start_s"] = round(cold_s, 2)  # type: ignore[index]
    publish(__file__, args, report)


if __name__ == "__main__":
    main()
