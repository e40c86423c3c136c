"""Recall and false-positive rate of the privacy detector on the synthetic corpus (`metaclaw.privacy.corpus`).

`python bench/studies/redaction.py [--seed 0] [--per-kind 10] [--clean 240]` prints JSON: per category (each secret kind
and each PII category) the share of planted items found (the finding covers the planted value, and the redacted text no
longer contains it); for the clean look-alikes, the share of turns that would be dropped (a secret found) and the
share in which each PII category fires. Targets (DESIGN.md): recall >= 99% on secrets, <= 1% of clean turns dropped.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from metaclaw.privacy.corpus import clean, planted  # noqa: E402
from metaclaw.privacy.detect import PII_CATEGORIES, SECRET, find_pii, find_secrets, redact  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-kind", type=int, default=10)
    p.add_argument("--clean", type=int, default=240)
    p.add_argument("--show-misses", action="store_true")
    add_results_argument(p)
    args = p.parse_args()
    t0 = time.perf_counter()
    found: dict[str, list[bool]] = defaultdict(list)
    misses = []
    items = planted(args.seed, args.per_kind)
    for item in items:
        findings = find_secrets(item.text) if item.category == SECRET else find_pii(item.text, [item.category])
        start = item.text.index(item.value)
        covered = any(f.start <= start + 1 and f.end >= start + len(item.value) - 1 for f in findings)
        ok = covered and item.value not in redact(item.text, findings)
        found[item.kind if item.category == SECRET else item.category].append(ok)
        if item.category == SECRET:
            found["secret (all)"].append(ok)
        if not ok:
            misses.append({"kind": item.kind, "text": item.text[:160], "found": [f.kind for f in findings]})
    cleans = clean(args.seed + 1, args.clean)
    dropped, pii_hits, fps = defaultdict(list), defaultdict(int), []
    for item in cleans:
        secrets = find_secrets(item.text)
        dropped[item.kind].append(bool(secrets))
        dropped["clean (all)"].append(bool(secrets))
        for f in {f.category for f in find_pii(item.text)}:
            pii_hits[f] += 1
        if secrets:
            shown = [item.text[f.start : f.end][:40] for f in secrets]
            fps.append({"kind": item.kind, "text": item.text[:160], "found": shown})
    elapsed = time.perf_counter() - t0
    out = {
        "planted_items": len(items),
        "clean_turns": len(cleans),
        "recall": {k: round(sum(v) / len(v), 4) for k, v in found.items()},
        "clean_dropped_rate": {k: round(sum(v) / len(v), 4) for k, v in dropped.items()},
        "clean_pii_flag_rate": {c: round(pii_hits[c] / len(cleans), 4) for c in PII_CATEGORIES},
        "ms_per_turn": round(1000 * elapsed / (len(items) + len(cleans)), 3),
    }
    if args.show_misses:
        out["misses"], out["false_positives"] = misses, fps
    publish(__file__, args, out)


if __name__ == "__main__":
    main()
