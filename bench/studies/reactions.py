"""How well do the CPU judges read people? The reaction classifier against the regex rule judge; prints JSON.

    python bench/studies/reactions.py              # the labelled set bench/data/reactions.jsonl (+ the demo's words)
    python bench/studies/reactions.py --data my.jsonl      # any JSONL of {text, label (-1|0|1), style}
    python bench/studies/reactions.py --prototype-cv       # also: leave-one-out accuracy on the prototypes themselves
    python bench/studies/reactions.py --people heldout     # also: the real-path people's reactions + next question
    python bench/studies/reactions.py --kinds      # only: bench/data/reactions_kinds.jsonl, per kind and category
    python bench/studies/reactions.py --kinds --data bench/data/reactions_fresh_kinds.jsonl   # the held-out set

`--kinds` reads the set of 413 reactions over 12 preference kinds nobody tuned the reader on (written and committed
before the reader was run on it; with `--data`, `reactions_heldout_kinds.jsonl` (4 kinds) or
`reactions_fresh_kinds.jsonl` (6 kinds, 228 messages, written before session 17 changed a rule: the held-out
figure; the two others are development sets since), or `reactions_no_verdict.jsonl` (session 24: 70 messages, the
held-out half of 140 written before the reader ran on them; `reactions_no_verdict_dev.jsonl` is the half the rules
were changed on): updates of the person's own request and follow-up questions in new forms, small talk, and
corrections of six new kinds that open like them; or `reactions_no_verdict_s26.jsonl` (session 26: 81 messages,
the held-out half of 163 written before the reader ran on them, split alternately per category and kind;
`reactions_no_verdict_s26_dev.jsonl` is the half new rules were tried on; none was kept, since the held-out half
did not move: docs/results/2026-11-30-session26.md): follow-up tasks in many forms
(extend, transform, a new case, the next step, "what about ...", "and for ...?", "ok now ..."), updates and small
talk, and corrections of ten new kinds (24-hour times, no markdown, ISO dates, gender-neutral words, type hints,
numbered steps, local currency, keeping the person's wording, for children, no exclamation marks) that open like
follow-ups): corrections as commands, questions ("Source?") and stated needs, praise, follow-up tasks after
praise, content corrections, request updates, small talk. It reports, per kind, the share of corrections read as
-1 and of follow-up tasks NOT read as -1, and leave-one-kind-out figures (see `kinds_report`).

The labelled set was written after the classifier's prototypes (`metaclaw/scoring/reaction_prototypes.jsonl`) and
shares none of them (tests/scoring/test_reactions.py checks it); the prototypes were not tuned on it. Reported for
both judges (`reactions`: `ReactionJudge` with conf/judge/reactions.yaml's settings; `rule`: `RuleJudge` with
conf/judge/rule.yaml's patterns): accuracy, per-class precision/recall, the confusion matrix (rows: the label
-1/0/1, columns: the verdict -1/0/1), accuracy per style; for the classifier also ms per reaction (one at a time,
as the scoring worker asks, and batched). `simulated_user` is the same on the demo's own phrasings (the simulated
user's thanks and corrections for every preference preset, with and without a next question).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from metaclaw.config import CONFIG_DIR, register_resolvers  # noqa: E402
from metaclaw.scoring.judges import RuleJudge  # noqa: E402
from metaclaw.scoring.reactions import LABELS, ReactionJudge, load_prototypes  # noqa: E402
from metaclaw.simulate.preferences import PreferenceSet  # noqa: E402
from metaclaw.simulate.tasks import load_tasks  # noqa: E402
from metaclaw.simulate.user import feedback  # noqa: E402
from metaclaw.store import Sample, SampleText  # noqa: E402

# Replies the simulated user judges (each breaks some presets and follows others).
REPLIES = [
    "The capital of France is Paris!",
    "Sure: it is about 5 km away.",
    "- one\n- two\n- three",
    "It takes 20 minutes. Hope this helps!",
    "Water boils at 100 degrees Celsius at sea level, which is the temperature at which its vapour pressure "
    "equals the atmospheric pressure around it, so at altitude it boils at a lower temperature.",
    "There are 206 bones in the adult human body.",
]


def judge_cfg(name: str) -> dict[str, Any]:
    """The judge's settings as conf/judge/NAME.yaml gives them (`${metaclaw_default:}` resolved to the code's)."""
    register_resolvers()
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "judge" / f"{name}.yaml"), resolve=True)
    return {k: v for k, v in cfg.items() if k != "_target_" and not str(k).startswith("defaults")}


def verdicts(judge: Any, texts: list[str]) -> list[int]:
    async def run() -> list[float]:
        return [(await judge.reward(Sample([1], [2], [-0.1], text=SampleText(next_state=t)))).reward for t in texts]

    return [int(v) for v in asyncio.run(run())]


def report(labels: list[int], preds: list[int], styles: list[str] | None = None) -> dict[str, Any]:
    """Accuracy, per-class precision/recall and the confusion matrix (rows label, columns verdict)."""
    idx = {c: i for i, c in enumerate(LABELS)}
    cm = np.zeros((3, 3), dtype=int)
    for y, p in zip(labels, preds, strict=True):
        cm[idx[y], idx[p]] += 1
    per_class = {}
    for c, i in idx.items():
        tp = cm[i, i]
        per_class[str(c)] = {
            "precision": round(tp / cm[:, i].sum(), 3) if cm[:, i].sum() else None,
            "recall": round(tp / cm[i].sum(), 3) if cm[i].sum() else None,
            "support": int(cm[i].sum()),
        }
    out: dict[str, Any] = {
        "accuracy": round(float(np.trace(cm) / cm.sum()), 3),
        "per_class": per_class,
        "confusion": {"rows_label_cols_verdict": list(LABELS), "matrix": cm.tolist()},
        "corrections_read_as_approval": int(cm[idx[-1], idx[1]]),
    }
    if styles is not None:
        by: dict[str, list[bool]] = defaultdict(list)
        for s, y, p in zip(styles, labels, preds, strict=True):
            by[s].append(y == p)
        out["per_style"] = {s: {"accuracy": round(sum(v) / len(v), 3), "n": len(v)} for s, v in sorted(by.items())}
    return out


def simulated_user_set(seed: int = 0) -> list[dict[str, Any]]:
    """The simulated user's own messages for every preference preset: -1 corrections, +1 thanks."""
    rng = random.Random(seed)
    tasks = [t.prompt for t in load_tasks(None, "train")]
    rows = []
    for preset in sorted((CONFIG_DIR / "preference").glob("*.yaml")):
        prefs = PreferenceSet(OmegaConf.to_container(OmegaConf.load(preset).rules))
        for reply in REPLIES:
            violations = prefs.check(reply)
            for nxt in (rng.choice(tasks), None):
                rows.append({"text": feedback(violations, nxt), "label": -1 if violations else 1, "style": preset.stem})
    return rows


def people_set(phrasings: str, seed: int = 0) -> list[dict[str, Any]]:
    """The real-path people's messages (`metaclaw.simulate.people`): every praise (+1) and correction (-1) phrasing
    of `people.yaml` (split `phrasings`), alone (a closing reaction) and joined to a next question by each of
    `JOINERS`, as `People.reaction` sends them. Praise shared by every kind is listed once (kind `any`)."""
    from metaclaw.simulate.people import JOINERS, PreferenceKind, kinds

    rng = random.Random(seed)
    tasks = [t.prompt for t in load_tasks(None, "train")]
    loaded = [PreferenceKind.load(name, phrasings) for name in kinds()]
    common = set.intersection(*(set(k.praise) for k in loaded))
    pools = [("any", 1, [p for p in loaded[0].praise if p in common])]
    for k in loaded:
        pools += [(k.name, 1, [p for p in k.praise if p not in common]), (k.name, -1, k.correction)]
    rows = []
    for kind, label, phrases in pools:
        for phrase in phrases:
            rows.append({"text": phrase, "label": label, "kind": kind, "joiner": "alone", "reaction": phrase})
            for joiner in JOINERS:
                text = f"{phrase}{joiner}{rng.choice(tasks)}"
                rows.append({"text": text, "label": label, "kind": kind, "joiner": repr(joiner), "reaction": phrase})
    return rows


def people_report(judge: ReactionJudge, phrasings: str) -> dict[str, Any]:
    """Confusion of the classifier on `people_set` overall, per joiner and per kind, and the reactions misread
    across the sign (a correction read as approval is the critical cell: it would be trained as a reward)."""
    rows = people_set(phrasings)
    preds = verdicts(judge, [r["text"] for r in rows])
    labels = [r["label"] for r in rows]
    out = report(labels, preds, [r["joiner"] for r in rows])
    out["per_joiner"] = out.pop("per_style")
    out["per_kind"] = {
        k: report([y for r, y in zip(rows, labels, strict=True) if r["kind"] == k],
                  [p for r, p in zip(rows, preds, strict=True) if r["kind"] == k])["confusion"]["matrix"]
        for k in dict.fromkeys(r["kind"] for r in rows)
    }  # fmt: skip
    flipped: dict[str, dict[str, list[str]]] = {"correction_as_approval": {}, "approval_as_correction": {}}
    for r, p in zip(rows, preds, strict=True):
        if r["label"] * p < 0:
            cell = flipped["correction_as_approval" if r["label"] < 0 else "approval_as_correction"]
            cell.setdefault(r["reaction"], []).append(r["joiner"])
    out["misread_across_sign"] = flipped
    return {"phrasings": phrasings, "n": len(rows), "reactions": out}


def prototype_cv(judge: ReactionJudge) -> dict[str, Any]:
    """Leave-one-out accuracy of the regression on the prototypes (how the settings were chosen)."""
    clf = judge.classifier
    texts, labels = zip(*load_prototypes(), strict=True)
    x, y = clf.features(list(texts)), np.array([LABELS.index(v) for v in labels])
    hits = 0
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        w = clf._fit(x[keep], y[keep], clf.l2)
        p = x[i] @ w
        hits += int(p.argmax() == y[i])
    return {"n": len(y), "accuracy": round(hits / len(y), 3)}


KINDS_DATA = REPO / "bench" / "data" / "reactions_kinds.jsonl"
# Messages that are no verdict on the reply: new work, a new question, an update of the person's own ask, small talk.
NO_VERDICT = ("follow_up", "new_question", "request_update", "small_talk")


def share(hits: list[bool]) -> float | None:
    return round(sum(hits) / len(hits), 3) if hits else None


def kinds_report(judge: ReactionJudge, path: Path = KINDS_DATA) -> dict[str, Any]:
    """The reader on `reactions_kinds.jsonl`: per category and per kind. The reader is rules over a regression
    fitted on the shipped prototypes (written for the real-path bench's kinds, never on this set), so every kind
    of this set is unseen: leave-one-kind-out is the per-kind figure itself (nothing is fitted or tuned on a kind
    of this set). `corrections_as_minus1` (target >= 0.8) and `follow_ups_not_minus1` (target >= 0.85) are the
    issue's two figures; `no_verdicts_not_minus1` the same over every message that is no verdict (`NO_VERDICT`);
    `per_kind[k].corrections` is kind k's share read as -1."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    preds = verdicts(judge, [r["text"] for r in rows])
    for r, p in zip(rows, preds, strict=True):
        r["pred"] = p
    corr = [r for r in rows if r["category"] == "correction"]
    follow = [r for r in rows if r["category"] == "follow_up"]
    no_verdict = [r for r in rows if r["category"] in NO_VERDICT]
    per_kind = {}
    for kind in sorted({r["kind"] for r in corr}):
        mine = [r for r in rows if r["kind"] == kind]
        per_kind[kind] = {
            "corrections": share([r["pred"] == -1 for r in mine if r["category"] == "correction"]),
            "praise": share([r["pred"] == 1 for r in mine if r["category"] == "praise"]),
            "follow_ups_not_minus1": share([r["pred"] != -1 for r in mine if r["category"] == "follow_up"]),
            "accuracy": share([r["pred"] == r["label"] for r in mine]),
        }
    return {
        "data": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
        "n": len(rows),
        "accuracy": share([r["pred"] == r["label"] for r in rows]),
        "corrections_as_minus1": share([r["pred"] == -1 for r in corr]),
        "follow_ups_not_minus1": share([r["pred"] != -1 for r in follow]),
        "no_verdicts_not_minus1": share([r["pred"] != -1 for r in no_verdict]),
        "corrections_as_approval": sum(r["pred"] == 1 for r in corr),
        "worst_kind_corrections": min(v["corrections"] for v in per_kind.values()),
        "per_category": {
            c: {
                "n": len(g),
                "accuracy": share([r["pred"] == r["label"] for r in g]),
                "verdicts": {str(v): sum(r["pred"] == v for r in g) for v in LABELS},
            }
            for c in sorted({r["category"] for r in rows})
            for g in [[r for r in rows if r["category"] == c]]
        },  # fmt: skip
        "per_phrasing_corrections": {
            f: share([r["pred"] == -1 for r in corr if r["phrasing"] == f])
            for f in sorted({r["phrasing"] for r in corr})
        },
        "per_kind": per_kind,
        "misread": [
            {"text": r["text"], "category": r["category"], "label": r["label"], "verdict": r["pred"]}
            for r in rows
            if r["pred"] != r["label"]
        ],  # fmt: skip
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="the labelled set (default: reactions.jsonl; with --kinds reactions_kinds.jsonl)")
    ap.add_argument("--prototype-cv", action="store_true")
    ap.add_argument("--people", choices=("train", "heldout", "all"), help="also the real-path people's phrasings")
    ap.add_argument("--kinds", action="store_true", help="only the 12-kind set (leave-one-kind-out figures)")
    ap.add_argument("--misread", action="store_true", help="with --kinds: list the misread reactions")
    add_results_argument(ap)
    args = ap.parse_args()
    args.data = args.data or str(KINDS_DATA if args.kinds else REPO / "bench" / "data" / "reactions.jsonl")
    if args.kinds:
        out = {}
        for form_rule in (False, True):  # the shipped reader, and with the form rule's real-path vocabulary
            judge = ReactionJudge(**{**judge_cfg("reactions"), "form_rule": form_rule})
            report_ = kinds_report(judge, Path(args.data).resolve())
            if not args.misread:
                report_.pop("misread")
            out["form_rule_on" if form_rule else "form_rule_off"] = report_
        publish(__file__, args, out)
        return
    rows = [json.loads(line) for line in Path(args.data).read_text(encoding="utf-8").splitlines() if line.strip()]
    texts, labels, styles = [r["text"] for r in rows], [int(r["label"]) for r in rows], [r["style"] for r in rows]

    t0 = time.perf_counter()
    reactions = ReactionJudge(**judge_cfg("reactions"))
    load_s = time.perf_counter() - t0
    rule = RuleJudge(**judge_cfg("rule"))

    reactions.classifier._cache.clear()
    t0 = time.perf_counter()
    ours = verdicts(reactions, texts)
    one_ms = (time.perf_counter() - t0) * 1000 / len(texts)
    reactions.classifier._cache.clear()
    t0 = time.perf_counter()
    reactions.classifier.classify_many(texts)
    batch_ms = (time.perf_counter() - t0) * 1000 / len(texts)
    regex = verdicts(rule, texts)

    sim = simulated_user_set()
    sim_texts, sim_labels = [r["text"] for r in sim], [r["label"] for r in sim]
    out: dict[str, Any] = {
        "data": str(Path(args.data).relative_to(REPO) if Path(args.data).is_relative_to(REPO) else args.data),
        "n": len(rows),
        "labels": {str(c): labels.count(c) for c in LABELS},
        "prototypes": len(load_prototypes()),
        "threshold": reactions.classifier.threshold,
        "reactions": report(labels, ours, styles),
        "rule": report(labels, regex, styles),
        "simulated_user": {
            "n": len(sim),
            "reactions": report(sim_labels, verdicts(reactions, sim_texts)),
            "rule": report(sim_labels, verdicts(rule, sim_texts)),
        },
        "ms_per_reaction": {"one_at_a_time": round(one_ms, 2), "batched": round(batch_ms, 2)},
        "load_s": round(load_s, 2),
        "load_avg_1min": round(os.getloadavg()[0], 2),  # the machine's load while measuring (2 cores)
    }
    out["accuracy_gain_points"] = round(100 * (out["reactions"]["accuracy"] - out["rule"]["accuracy"]), 1)
    if args.people:
        out["people"] = people_report(reactions, args.people)
    if args.prototype_cv:
        out["prototype_leave_one_out"] = prototype_cv(reactions)
    publish(__file__, args, out)


if __name__ == "__main__":
    main()
