"""Verifiers (one per preference kind) and the simulated user's feedback, which the rule judge turns into reward
and OPD hint."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from metaclaw.scoring.judges import RuleJudge
from metaclaw.simulate import KINDS, PreferenceSet, feedback, load_tasks
from metaclaw.store import Sample, SampleText

CASES = [
    ({"kind": "starts_with", "text": "Sure thing:"}, "Sure thing: Paris.", "The capital is Paris."),
    ({"kind": "ends_with", "text": "Hope this helps."}, "Paris. Hope this helps.", "Paris. Hope this helps!"),
    ({"kind": "max_words", "limit": 5}, "It is Paris.", "The capital of France is Paris, a big city."),
    ({"kind": "bullets", "min_items": 2}, "- boil water\n- add eggs", "Boil water, then add eggs."),
    ({"kind": "bullets", "min_items": 2}, "1. boil water\n2) add eggs", "1. boil water only"),
    ({"kind": "no_exclamation"}, "Paris.", "Paris!"),
    ({"kind": "gives_number"}, "About 384,400 km.", "Quite far away."),
    ({"kind": "states_units"}, "About 384,400 km: light takes 1.3 seconds.", "About 384400."),
    ({"kind": "states_units"}, "Bake at 200°C for 45 minutes.", "Bake it until golden."),
    ({"kind": "regex", "pattern": r"\?$", "description": "End with a question"}, "Paris. Anything else?", "Paris."),
    ({"kind": "regex", "pattern": "(?i)sorry", "description": "Never apologise", "must_match": False}, "Ok.", "Sorry."),
]


@pytest.mark.parametrize(("rule", "good", "bad"), CASES, ids=[f"{c[0]['kind']}-{i}" for i, c in enumerate(CASES)])
def test_verifier_accepts_compliant_and_names_the_problem(rule, good, bad):
    prefs = PreferenceSet([rule])
    assert prefs.check(good) == []
    (v,) = prefs.check(bad)
    assert v.kind == rule["kind"] and v.problem and v.instruction.endswith(".")


def test_every_kind_is_covered_and_unknown_kinds_are_refused():
    assert {c[0]["kind"] for c in CASES} == set(KINDS)
    with pytest.raises(ValidationError, match="kind"):
        PreferenceSet([{"kind": "telepathy"}])
    with pytest.raises(ValidationError, match="limit"):
        PreferenceSet([{"kind": "max_words"}])
    with pytest.raises(ValidationError, match="extra"):
        PreferenceSet([{"kind": "no_exclamation", "surprise": 1}])
    with pytest.raises(ValueError, match="empty"):
        PreferenceSet([])


def test_all_rules_must_hold_and_an_empty_reply_never_complies():
    prefs = PreferenceSet([{"kind": "starts_with", "text": "Sure:"}, {"kind": "no_exclamation"}])
    assert [v.kind for v in prefs.check("Sure: yes!")] == ["no_exclamation"]
    assert [v.kind for v in prefs.check("No!")] == ["starts_with", "no_exclamation"]
    assert prefs.check("   ")[0].kind == "answered"
    assert PreferenceSet([{"kind": "max_words", "limit": 3}]).check("")[0].kind == "answered"


def _sample(next_state: str) -> Sample:
    return Sample(
        agent_id="a", session_id="s", turn_index=0, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[-0.1],
        temperature=1.0, text=SampleText(next_state=next_state),
    )  # fmt: skip


def test_feedback_is_thanks_or_a_correction_the_rule_judge_reads_as_reward_and_hint():
    judge = RuleJudge()
    prefs = PreferenceSet([{"kind": "starts_with", "text": "Sure thing:"}])
    # A next question that itself contains a "negative" word must not turn thanks into a correction.
    thanks = feedback(prefs.check("Sure thing: Paris."), "Why did my build fail?")
    assert thanks.startswith("Thanks") and thanks.endswith("Next question: Why did my build fail?")
    assert asyncio.run(judge.reward(_sample(thanks))).reward == 1.0
    assert asyncio.run(judge.hint(_sample(thanks))) is None

    correction = feedback(prefs.check("The capital is Paris."), "How tall is Everest?")
    assert asyncio.run(judge.reward(_sample(correction))).reward == -1.0
    hint = asyncio.run(judge.hint(_sample(correction)))
    assert hint == "Your reply started with 'The capital is Paris.'. Always start your reply with 'Sure thing:'."
    assert "Everest" not in hint  # the next question is not part of the hint
    last = feedback(prefs.check("Nope"))  # the session's last message: feedback alone
    assert "Next question" not in last and asyncio.run(judge.hint(_sample(last))).endswith("'Sure thing:'.")


def test_packaged_tasks_have_domains_and_a_heldout_split():
    train, held = load_tasks(split="train"), load_tasks(split="heldout")
    assert len(train) + len(held) >= 100 and len(held) >= 20
    assert len({t.domain for t in held}) >= 5
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    with pytest.raises(ValueError, match="no tasks"):
        load_tasks(split="nope")


def test_user_waits_while_enough_turns_wait_to_be_trained():
    """`max_ahead`: no session starts while the backlog is at the bound; it starts once training caught up."""
    import time

    from metaclaw.simulate.user import SimulatedUser

    backlog = [8]
    user = SimulatedUser("http://127.0.0.1:9/v1", [{"kind": "no_exclamation"}], concurrency=1, max_ahead=8, timeout_s=1)
    user.backlog = lambda: backlog[0]
    user.start()
    try:
        time.sleep(2.5)
        assert user.driver.figures()["started"] == 0 and user.stats["waited_s"] >= 1.0
        backlog[0] = 7
        deadline = time.monotonic() + 10
        while user.driver.figures()["started"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert user.driver.figures()["started"] >= 1  # port 9 refuses: the session fails, but it was started
    finally:
        user.stop(5)
