"""Would a head fitted on the labelled reactions read unseen sets better than the reader? Prints JSON.

    python bench/studies/reaction_head.py            # each held-out set, the head fitted on every other set
    python bench/studies/reaction_head.py --loko     # also leave-one-kind-out over the pooled sets (slow)
    python bench/studies/reaction_head.py --data-dir DIR   # the reactions*.jsonl sets of DIR instead

The reaction reader (`scoring.reactions`) is a softmax regression over sentence-encoder features fitted on its own
prototypes, with grammar rules (`scoring.speech_acts`) above it. Here the same regression is fitted on the labelled
sets in bench/data/reactions*.jsonl instead: the encoder's features of the whole message, the speech acts of its
first sentence, and the reader's own verdict. Each held-out set is read by a head fitted on every set but it (and
but its development half), so the figure asks whether the people-written sets carry what the prototypes lack.
Session 28: on `reactions_no_verdict_s26` the head is no better than the reader (70.0% of corrections as -1 for
both; 75.0% of follow-ups not, against the reader's 77.8%): what separates "Could you add a section on ..." (new work)
from "Could you make it ..." (an edit) is not in these features.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from metaclaw.scoring.reactions import LABELS, ReactionClassifier, sentences  # noqa: E402
from metaclaw.scoring.speech_acts import follow_up, is_question, objection, update  # noqa: E402

DATA = REPO / "bench" / "data"
HELD_OUT = ("reactions_no_verdict_s26", "reactions_no_verdict", "reactions_fresh_kinds", "reactions_heldout_kinds")


def acts(text: str) -> list[float]:
    """The speech acts of the first sentence, and whether more follows."""
    sents = sentences(text) or [text]
    first = sents[0]
    return [float(bool(objection(first))), float(bool(follow_up(first))), float(bool(update(first))),
            float(bool(is_question(first))), float(len(sents) > 1)]  # fmt: skip


def shares(rows: Sequence[dict[str, Any]], pred: Sequence[int]) -> dict[str, float | None]:
    """Corrections read as -1; follow-up tasks and messages with no verdict not read as -1; accuracy."""
    lab = np.array([r["label"] for r in rows])
    got = np.array(pred)
    follow = np.array([r.get("category") == "follow_up" for r in rows])
    every = np.ones(len(rows), bool)

    def share(mask: np.ndarray, hit: np.ndarray) -> float | None:
        return round(float(hit[mask].mean()), 3) if mask.any() else None

    return {"corrections_as_minus1": share(lab == -1, got == -1), "follow_ups_not_minus1": share(follow, got != -1),
            "no_verdict_not_minus1": share(lab == 0, got != -1), "accuracy": share(every, got == lab)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loko", action="store_true", help="also leave-one-kind-out over the pooled sets")
    p.add_argument("--l2", type=float, default=3e-4)
    p.add_argument("--data-dir", type=Path, default=DATA, help="the folder of the reactions*.jsonl sets")
    add_results_argument(p)
    args = p.parse_args()
    rows, names = [], []
    for f in sorted(args.data_dir.glob("reactions*.jsonl")):
        for line in f.read_text().splitlines():
            rows.append(json.loads(line))
            names.append(f.stem)
    texts = [r["text"] for r in rows]
    clf = ReactionClassifier()
    reader = [int(r.verdict) for r in clf.classify_many(texts)]
    verdict = np.eye(3, dtype=np.float32)[[LABELS.index(v) for v in reader]]
    x = np.concatenate([clf.features(texts), 2 * np.array([acts(t) for t in texts], np.float32), 2 * verdict], axis=1)
    y = np.array([LABELS.index(r["label"]) for r in rows])

    def head(train: list[int], test: list[int]) -> list[int]:
        w = ReactionClassifier._fit(x[train], y[train], args.l2)
        return [LABELS[k] for k in (x[test] @ w).argmax(1)]

    report: dict[str, Any] = {}
    for held in (h for h in HELD_OUT if h in names):
        out = {held, f"{held}_dev"}
        train = [i for i, n in enumerate(names) if n not in out]
        test = [i for i, n in enumerate(names) if n == held]
        report[held] = {"n": len(test), "head": shares([rows[i] for i in test], head(train, test)),
                        "reader": shares([rows[i] for i in test], [reader[i] for i in test])}  # fmt: skip
    if args.loko:
        kinds = sorted({r["kind"] for r in rows if r.get("kind") not in (None, "-")})
        test_all, pred_all = [], []
        for kind in kinds:
            test = [i for i, r in enumerate(rows) if r.get("kind") == kind]
            pred_all += head([i for i, r in enumerate(rows) if r.get("kind") != kind], test)
            test_all += test
        seen = [rows[i] for i in test_all]
        report["leave_one_kind_out"] = {"kinds": len(kinds), "n": len(test_all), "head": shares(seen, pred_all),
                                        "reader": shares(seen, [reader[i] for i in test_all])}  # fmt: skip
    publish(__file__, args, report)


if __name__ == "__main__":
    main()
