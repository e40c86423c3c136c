"""The publish gate's one rule on compliance (`metaclaw.evaluation.gate.compliance_test`), the same for the
verifier path (`_decide`) and the judge fallback (`_decide_on_turns`), on the figures real runs recorded, and the
quality guard's default (`publish.gate.max_nll_increase`). The decisions run through the live service's own
`LiveEvaluator` (built from the composed `rollout=proxy` config); only the evidence is given, as the evaluators
would hand it over (the real-server paths: tests/evaluation/test_proxy_gate.py, tests/evaluation/test_live_eval.py).

A refusal on a point estimate over a handful of effective turns was close to a coin flip: in real-path runs
(`bench/runs/learning.py --real-path`) the gate refused most candidates on an estimate resting on 2-3 effective turns,
and the served adapter lagged the trainer by 20-31 versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metaclaw.agents import DEFAULT_PROFILE
from metaclaw.evaluation import LiveEvaluator
from metaclaw.evaluation.evaluator import EvalResult, ReplyQuality
from metaclaw.evaluation.gate import compliance_test
from metaclaw.evaluation.regression import RegressionWatch
from metaclaw.evaluation.stats import newcombe
from metaclaw.loop.eval_wiring import build_evaluator
from tests.entrypoints.test_train import compose_train

# gate.jsonl of a real-path run (`bench/runs/learning.py --real-path`, summary_first, session 7), step 40: refused by
# the old rule, its estimate resting on 2.45 effective turns of 32.
REAL_PATH_STEP_40 = {
    "n": 32, "observed": 0.53125,
    "served": {"model": "policy", "compliance": 0.53125, "n_eff": 32.0, "ci_low": 0.36449516999131165,
               "ci_high": 0.6913061300233958},
    "candidate": {"model": "step-000040", "compliance": 0.24024194424130513, "n_eff": 2.451444337176244,
                  "ci_low": 0.02926211655112554, "ci_high": 0.7683567589604676},
    "served_nll": 3.202960005113567, "candidate_nll": 2.406292918303739, "quality_turns": 8,
}  # fmt: skip


def test_newcombe_reproduces_the_published_intervals():
    """Newcombe (1998), Statistics in Medicine 17:873-890, Table II, method 10 (hybrid score), 95%."""
    for (k1, n1, k2, n2), expected in (((56, 70, 48, 80), (0.0524, 0.3339)), ((9, 10, 3, 10), (0.1705, 0.8090)),
                                       ((5, 56, 0, 29), (-0.0381, 0.1926))):  # fmt: skip
        low, high = newcombe(k1 / n1, n1, k2 / n2, n2)
        assert low == pytest.approx(expected[0], abs=1e-4) and high == pytest.approx(expected[1], abs=1e-4)
    assert newcombe(0.0, 0, 1.0, 0)[1] >= 0.0  # no evidence: no difference is ruled out


@pytest.mark.parametrize(
    ("candidate", "candidate_n", "served", "served_n", "finding"),
    [
        (0.0, 10.0, 0.5, 20.0, "worse"),  # writes what users corrected (tests/evaluation/test_proxy_gate.py)
        (0.0, 32, 0.5, 32, "worse"),  # the verifier: nothing complies of 32 replies
        (0.0, 6, 1.0, 6, "worse"),  # the verifier in tests/evaluation/test_live_eval.py
        (0.24024194424130513, 2.451444337176244, 0.53125, 32.0, "inconclusive"),  # real path, step 40
        (0.314, 3.0, 0.531, 32.0, "inconclusive"),  # real path, step 52
        (0.324, 14.2, 0.429, 21.0, "inconclusive"),  # real path, step 8
        (0.34, 32, 0.5, 32, "inconclusive"),  # the verifier: 16 points down on 32 replies each
        (0.406, 13.3, 0.467, 15.0, "within_margin"),
        (0.9, 32, 0.5, 32, "within_margin"),
    ],
)
def test_the_rule_refuses_only_a_candidate_shown_worse(candidate, candidate_n, served, served_n, finding):
    test = compliance_test(candidate, candidate_n, served, served_n, margin=0.1, alpha=0.05)
    assert test["finding"] == finding
    assert test["z"] == pytest.approx(1.6449, abs=1e-4)  # one-sided 95%
    _, high = newcombe(candidate, candidate_n, served, served_n, test["z"])  # recomputable from the record
    assert test["upper_bound"] == pytest.approx(high) and (high < -0.1) == (finding == "worse")


@pytest.fixture
def live(tmp_path) -> LiveEvaluator:
    """The gate as `python train.py rollout=proxy` builds it, its regression watch on (no server: nothing polls)."""
    gate = build_evaluator(compose_train(tmp_path, "rollout=proxy"))
    assert gate is not None and gate.gate
    gate.watch = RegressionWatch(store=None, rollback=lambda step, agent: {})
    return gate


def gate_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "gate.jsonl").read_text().splitlines()]


def test_the_judge_fallback_serves_a_candidate_the_evidence_cannot_tell_and_says_so(live, tmp_path, caplog):
    """Step 40 of a real-path run: estimate 0.24 vs served 0.53 (more than the margin below), but over 2.45
    effective turns the interval spans 0.03-0.77. The old rule refused it; now it is served, the record and the
    log say the evidence was inconclusive, and who guards it."""
    served: list[Path] = []
    path = tmp_path / "step-000040"
    decision = live.gatekeeper.decide_on_turns(live.tracks[DEFAULT_PROFILE], 40, path, REAL_PATH_STEP_40, served.append)
    assert decision["decision"] == "accepted" and served == [path]
    record = gate_records(tmp_path)[-1]
    assert record["decision"] == "accepted" and record["finding"] == "inconclusive"
    assert record["guarded_by"] == "publish.gate.rollback" and "inconclusive" in record["note"]
    test = record["compliance_test"]
    assert (test["candidate_n"], test["served_n"]) == (2.451444337176244, 32.0)
    assert test["upper_bound"] == pytest.approx(newcombe(0.24024194424130513, 2.451444337176244, 0.53125, 32.0,
                                                         test["z"])[1])  # fmt: skip
    assert live.counts["gate_accepted"] == 1 and live.counts["gate_inconclusive"] == 1
    assert "served on inconclusive evidence" in caplog.text and "regression watch" in caplog.text


def test_the_judge_fallback_refuses_a_candidate_shown_worse(live, tmp_path):
    """The same turns, but the candidate's weight spread over 12 effective turns that users corrected."""
    evidence = json.loads(json.dumps(REAL_PATH_STEP_40))
    evidence["candidate"].update(compliance=0.04, n_eff=12.0)
    served: list[Path] = []
    decision = live.gatekeeper.decide_on_turns(live.tracks[DEFAULT_PROFILE], 44, tmp_path / "step-000044", evidence,
                                     served.append)  # fmt: skip
    assert decision["decision"] == "rejected" and served == [] and decision["finding"] == "worse"
    assert decision["reasons"][0].startswith("estimated compliance 0.04 (n 12.0) vs served 0.53 (n 32.0): worse")
    assert live.counts["gate_rejected"] == 1 and live.counts["gate_inconclusive"] == 0


def test_the_quality_guard_allows_what_learning_a_rare_preference_costs(live, tmp_path):
    """The base NLL of replies that follow a preference the base model rarely follows rises by itself: the main
    job's best adapter (90.6% compliance) went 1.92 -> 2.87 and was refused at the old 0.5; a collapse beyond the
    default 1.0 (the eval's own fluency margin) is still refused."""
    assert live.gatekeeper.max_nll_increase == 1.0
    track = live.tracks[DEFAULT_PROFILE]
    evidence = json.loads(json.dumps(REAL_PATH_STEP_40))
    evidence["candidate"].update(compliance=0.53, n_eff=20.0)
    evidence["candidate_nll"] = evidence["served_nll"] + 0.94
    served: list[Path] = []
    assert live.gatekeeper.decide_on_turns(track, 48, tmp_path / "a", evidence, served.append)["decision"] == "accepted"
    evidence["candidate_nll"] = evidence["served_nll"] + 1.2
    refused = live.gatekeeper.decide_on_turns(track, 52, tmp_path / "b", evidence, served.append)
    assert refused["decision"] == "rejected" and "quality collapsed" in refused["reasons"][0]
    assert refused["quality_turns"] == 8 and "same 8 prompts" in refused["reasons"][0]
    assert served == [tmp_path / "a"]


class Verifier:
    """What `_decide` reads of the verifier's evaluator besides the candidate's result: the base model's NLL."""

    reference_nll = 1.9242465094559724  # the main job's base model (session 7)


def test_the_verifier_path_uses_the_same_rule_and_guard(live, tmp_path):
    """The verifier's 32 fresh replies per candidate: 16 points below the served 50% is within the noise of two
    samples of 32 (served, said inconclusive); nothing complying is clearly worse (refused). The main job's step 52
    (90.6% vs 65.6%, base NLL 1.92 -> 2.87) is served under the default quality guard."""
    track = live.tracks[DEFAULT_PROFILE]
    track.evaluator = Verifier()
    track.served_score, track.served_n = 0.5, 32
    served: list[Path] = []
    gate = live.gatekeeper
    inconclusive = gate.decide(
        track, 4, tmp_path / "s4", EvalResult("c", 0.34375, 32, quality=ReplyQuality(nll=2.1)), served.append
    )
    assert inconclusive["decision"] == "accepted" and inconclusive["finding"] == "inconclusive"
    assert inconclusive["guarded_by"] == "publish.gate.rollback" and track.served_score == 0.34375
    worse = gate.decide(
        track, 8, tmp_path / "s8", EvalResult("c", 0.0, 32, quality=ReplyQuality(nll=2.0)), served.append
    )
    assert worse["decision"] == "rejected" and worse["finding"] == "worse"
    assert worse["reasons"][0].startswith("compliance 0.00 (n 32.0) vs served 0.34 (n 32.0): worse by more than")
    assert track.served_score == 0.34375  # a refused candidate does not move the bar
    track.served_score = 0.65625
    best = gate.decide(
        track,
        52,
        tmp_path / "s52",
        EvalResult("c", 0.90625, 32, quality=ReplyQuality(nll=2.8688357646266627)),
        served.append,
    )
    assert best["decision"] == "accepted" and best["max_nll_increase"] == 1.0
    assert served == [tmp_path / "s4", tmp_path / "s52"]
    records = gate_records(tmp_path)
    assert [r["decision"] for r in records] == ["accepted", "rejected", "accepted"]
    assert all(r["compliance_test"]["rule"] == records[0]["compliance_test"]["rule"] for r in records)


def test_after_a_rollback_the_bar_is_the_restored_adapter_not_the_base_model(live, tmp_path):
    """A rollback forgets the served score; the next candidate is compared with what the agent is answered by
    then (the restored adapter, served as `policy`), not with the base model (which would lower the bar)."""
    track = live.tracks[DEFAULT_PROFILE]
    scored: list[str] = []

    class Evaluator(Verifier):
        def score(self, model: str) -> EvalResult:
            scored.append(model)
            return EvalResult(model, 0.75 if model == "policy" else 0.2, 32)

    track.evaluator = Evaluator()
    live.gatekeeper.server_url = "http://127.0.0.1:9"  # never asked: what it serves is read through served_model
    live.gatekeeper.served_model = lambda t: ("policy", 12)
    track.served_score = track.served_n = None  # what check_regressions leaves after a rollback
    candidate = EvalResult("c", 0.3, 32, quality=ReplyQuality(nll=2.0))
    decision = live.gatekeeper.decide(track, 16, tmp_path / "s16", candidate, [].append)
    assert scored == ["policy"] and decision["served"] == 0.75
    assert decision["decision"] == "rejected" and decision["finding"] == "worse"  # 0.30 vs the restored 0.75
