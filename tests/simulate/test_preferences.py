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
    ({"kind": "max_sentences", "limit": 1}, "It is Paris, on the Seine.", "It is Paris. It is on the Seine."),
    ({"kind": "no_emoji"}, "Paris, of course.", "Paris, of course 🙂"),
    ({"kind": "gives_number"}, "About 384,400 km.", "Quite far away."),
    ({"kind": "gives_number"}, "1. Boil water\n2. Add 2 eggs", "1. Boil water\n2) Add the eggs"),  # items' numbers
    ({"kind": "states_units"}, "About 384,400 km: light takes 1.3 seconds.", "About 384400."),
    ({"kind": "states_units"}, "Bake at 200°C for 45 minutes.", "Bake it until golden."),
    ({"kind": "states_units"}, "1. Preheat to 200°C\n 2. Bake 45 minutes", "1. Preheat the oven\n2. Bake it"),
    ({"kind": "regex", "pattern": r"\?$", "description": "End with a question"}, "Paris. Anything else?", "Paris."),
    ({"kind": "regex", "pattern": "(?i)sorry", "description": "Never apologise", "must_match": False}, "Ok.", "Sorry."),
]


@pytest.mark.parametrize(("rule", "good", "bad"), CASES, ids=[f"{c[0]['kind']}-{i}" for i, c in enumerate(CASES)])
def test_verifier_accepts_compliant_and_names_the_problem(rule, good, bad):
    prefs = PreferenceSet([rule])
    assert prefs.check(good) == []
    (v,) = prefs.check(bad)
    assert v.kind == rule["kind"] and v.problem and v.instruction.endswith(".")


TEN = "one two three four five six seven eight nine ten"


@pytest.mark.parametrize(
    ("reply", "complies"),
    [
        (f"{TEN}.", True),  # exactly min_words
        ("one two three four five six seven eight nine.", False),  # a word short, whatever the sentences
        (f"{TEN}. Two. Three.", True),  # exactly the limit
        (f"{TEN}. Two. Three. Four.", False),
        (f"{TEN}. Two. Three. Four", False),  # an unfinished last sentence counts
        (f"Pi is 3.14159 and e is 2.71828, {TEN}. Two! Three?", True),  # a mark inside a word does not split
        (f"Wait... really?! {TEN}.", True),  # a run of marks ends one sentence
        (f"Fruit, e.g. apples. {TEN}. Three. Four.", False),  # "e.g. " splits: CLaaS's rule, kept
        ("- one\n- two\n- three\n- four\n- five\n- six\n- seven\n- eight\n- nine\n- ten", True),  # no marks: 1
        (f"{TEN}.\nTwo.\nThree.\nFour.", False),  # a newline after a mark splits
        (f"  {TEN}.   ", True),
    ],
)
def test_max_sentences_counts_as_claas_concise_does(reply, complies):
    """CLaaS's `concise` (claas/eval/metrics/verifiers.py, ConciseVerifier): >= 10 words and <= 3 sentences."""
    prefs = PreferenceSet([{"kind": "max_sentences", "limit": 3, "min_words": 10}])
    assert prefs.complies(reply) is complies
    if not complies:
        (v,) = prefs.check(reply)
        assert v.instruction == "Keep your reply to 3 sentences or fewer, but answer in at least 10 words."


@pytest.mark.parametrize(
    ("reply", "complies"),
    [
        ("Plain text, café, naïve, 東京, → and × and €.", True),  # letters of any script, math and currency signs
        ("Zero\u200dwidth joiner and variation selector\ufe0f alone.", True),  # format and mark characters
        ("Great job 🎉", False),
        ("Flag: 🇫🇷", False),
        ("Skin tone alone: \U0001f3fd", False),  # a modifier (category Sk) inside the pictograph blocks
        ("Unassigned in a block: \U0001faff", False),
        ("Hearts ♥ and stars ★", False),  # 'So' in the basic plane
        ("It is 20°C", False),  # the degree sign is 'So' too: CLaaS's definition, kept
        ("© 2024 and ™", False),
    ],
)
def test_no_emoji_counts_as_claas_no_emoji_does(reply, complies):
    """CLaaS's `no_emoji` (NoEmojiVerifier): no character of category 'So' nor of the listed emoji blocks."""
    assert PreferenceSet([{"kind": "no_emoji"}]).complies(reply) is complies


def test_every_kind_is_covered_and_unknown_kinds_are_refused():
    assert {c[0]["kind"] for c in CASES} == set(KINDS)
    with pytest.raises(ValidationError, match="kind"):
        PreferenceSet([{"kind": "telepathy"}])
    with pytest.raises(ValidationError, match="limit"):
        PreferenceSet([{"kind": "max_words"}])
    with pytest.raises(ValidationError, match="limit"):
        PreferenceSet([{"kind": "max_sentences", "limit": 0}])
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
