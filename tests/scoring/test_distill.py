"""Learning from the words (issue 42): a correction that states a preference becomes a distilled sample.

The teacher is a real HTTP server (the scripted upstream: word ids, chat logprobs -0.25, prompt logprobs -0.5, so
every hinted reply gains 0.25 nats per token over the plain prompt); the judge is the default reaction reader.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from functools import partial

import pytest

from metaclaw.modules.health import HealthMonitor
from metaclaw.privacy import PrivacyPolicy
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import prompt_ids, scripted_upstream, word_ids
from metaclaw.scoring.distill import (
    YIELD_WINDOW,
    ContextDistiller,
    accepts,
    fresh_conversation,
    hinted_conversation,
    stated_preference,
    token_gain,
    unasked_conversation,
)
from metaclaw.scoring.judges import RuleJudge
from metaclaw.scoring.reactions import ReactionJudge
from metaclaw.scoring.worker import DISTILL_BACKLOG, ScoringWorker
from metaclaw.store import Sample, SampleStore, SampleText

# The mechanisms as seed 002 states them (+1 at least once, closing turns judged); the product's rules are
# ScoringWorker's defaults (off, drop): tests/test_configs.py
SeedRulesWorker = partial(ScoringWorker, at_least_one=True, no_next_state="score")

REPLAYS = inspect.signature(ContextDistiller).parameters["replays"].default  # each accepted reply's later steps
PREFERENCE = "Your name is Kuro, always introduce yourself as Kuro."  # CLaaS's identity feedback string
QUESTION = [{"role": "user", "content": "How long should pasta cook?"}]


@pytest.fixture(scope="module")
def judge():
    return ReactionJudge()


def turn(store: SampleStore, next_state: str | None, session: str = "s1") -> int:
    prompt = [1, *word_ids("user How long should pasta cook?"), 2]
    return store.insert(
        Sample(
            prompt,
            [11, 12, 3],
            [-1.0, -1.0, -1.0],
            session_id=session,
            text=SampleText(messages=QUESTION, response_text="About ten minutes.", next_state=next_state),
        )
    )


def run(store: SampleStore, judge, url: str, min_gain: float = 0.1, context: str = "fresh",
        temperature: float | None = None, min_relevance: float | None = None, **kw) -> ScoringWorker:  # fmt: skip
    """The scripted teacher's prompt logprobs are one constant, so a reply scored again under the turn's
    distribution gains nothing: these tests sample at the turn's own temperature (`temperature=None`) unless they
    test the cooler teacher itself."""
    distiller = ContextDistiller(url, "tiny", min_gain=min_gain, samples=1, context=context, own_reply=True,
                                 temperature=temperature, min_relevance=min_relevance)  # fmt: skip
    worker = SeedRulesWorker(store, judge, session_idle_s=1e9, at_least_one=False, no_next_state="drop",
                           distiller=distiller, **kw)  # fmt: skip
    asyncio.run(worker.run_once())
    return worker


def distilled(store: SampleStore) -> list[Sample]:
    """The teacher's hinted replies that were accepted (not the corrected reply's own row: `own`)."""
    return [s for s in store.select() if s.meta.distilled is not None and s.meta.distilled.get("kind") != "own"]


def own(store: SampleStore) -> list[Sample]:
    """The corrected reply's own row, trained toward the hinted teacher's top-k (`own_reply`)."""
    return [s for s in store.select() if s.meta.distilled is not None and s.meta.distilled.get("kind") == "own"]


@pytest.mark.parametrize(
    ("correction", "kept"),
    [
        (f"No. {PREFERENCE}\n\nHow tall is Everest?", PREFERENCE),
        (f"{PREFERENCE} Next: how tall is Everest?", PREFERENCE),
        ("Please give me a number next time. Another one: name three rivers.", "Please give me a number next time."),
        ("Great. Now give me a shorter version for Twitter.", None),  # a follow-up task
        ("You're Kuro.\nHow tall is Everest?", "You're Kuro."),
        ("What about rice?", None),  # a new question
        ("Oops, I meant six people.", None),  # the person updates their own request
        ("Nope.", None),
        ("", None),
    ],
)
def test_stated_preference_keeps_what_the_person_wants_and_nothing_else(correction, kept):
    assert stated_preference(correction) == kept


def test_hinted_forms_put_the_preference_in_context_and_leave_the_input_alone():
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    system = hinted_conversation(messages, "Ten minutes.", PREFERENCE, "system")
    assert system[0]["content"] == f"Be brief.\n\n{PREFERENCE}" and system[1:] == QUESTION
    assert hinted_conversation(QUESTION, "x", PREFERENCE, "system")[0] == {"role": "system", "content": PREFERENCE}
    assert hinted_conversation(QUESTION, "x", PREFERENCE, "prefix")[-1]["content"].startswith(PREFERENCE)
    assert PREFERENCE in hinted_conversation(QUESTION, "x", PREFERENCE, "suffix")[-1]["content"]
    restate = hinted_conversation(QUESTION, "Ten minutes.", PREFERENCE, "restate")
    assert [m["role"] for m in restate] == ["user", "assistant", "user"]
    assert restate[-1]["content"] == f"{PREFERENCE}\n\nHow long should pasta cook?"
    assert messages[0]["content"] == "Be brief." and len(messages) == 2  # copies, never the turn's own messages
    with pytest.raises(ValueError, match="form"):
        hinted_conversation(QUESTION, "x", PREFERENCE, "elsewhere")
    assert token_gain([-1.0, -2.0], [-2.0, -2.0]) == pytest.approx(0.5)


def test_the_unasked_conversation_is_the_hinted_one_without_the_request():
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert unasked_conversation(QUESTION, "x", PREFERENCE, "prefix") == [{"role": "user", "content": PREFERENCE}]
    assert unasked_conversation(messages, "x", PREFERENCE, "system") == [
        {"role": "system", "content": f"Be brief.\n\n{PREFERENCE}"}, {"role": "user", "content": ""}]  # fmt: skip
    (suffix,) = unasked_conversation(QUESTION, "x", PREFERENCE, "suffix")
    assert PREFERENCE in suffix["content"] and "pasta" not in suffix["content"]
    restate = unasked_conversation(QUESTION, "Ten minutes.", PREFERENCE, "restate")
    assert restate[-1] == {"role": "user", "content": PREFERENCE} and "pasta" not in restate[0]["content"]
    assert QUESTION[0]["content"] == "How long should pasta cook?"  # a copy
    assert accepts(0.6, 0.5) and not accepts(0.4, 0.5)  # no relevance bound: the gain alone
    assert accepts(0.6, 0.5, 0.2, 0.1) and not accepts(0.6, 0.5, 0.05, 0.1) and not accepts(0.6, 0.5, None, 0.1)


@pytest.mark.parametrize(("alone", "kept"), [(-0.25, False), (-0.5, True)])
def test_a_hinted_reply_the_request_does_not_explain_is_not_trained(tmp_path, judge, alone, kept):
    """The scripted teacher scores the plain prompt (the request alone) at -0.5 a token and the preference alone at
    `alone`; the hinted reply was sampled at -0.25. At -0.25 the reply is as likely without the request (it talks
    about the correction and answers nothing: relevance 0); at -0.5 the request explains 0.25 nats of it."""
    pasta = set(word_ids("pasta"))
    app = scripted_upstream("I am Kuro.", prompt_logprob=lambda ids: -0.5 if pasta & set(ids) else alone)
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app) as up:
        turn(store, f"{PREFERENCE}\n\nHow tall is Everest?")
        worker = run(store, judge, up.url, min_gain=0.2, min_relevance=0.1)
        asked = [r["messages"] for r in app.state.scripted["requests"]]
    assert asked[-1] == [{"role": "user", "content": PREFERENCE}]  # the preference alone, rendered for the teacher
    assert len(distilled(store)) == int(kept)
    assert worker.distiller.stats["off_request"] == int(not kept)
    monitor = HealthMonitor(str(store.path))
    monitor.attach(worker=worker)
    assert monitor.snapshot()["rollout/distill_off_request"] == float(not kept)  # in the logger and `status`
    if kept:
        assert distilled(store)[0].meta.distilled["relevance"] == pytest.approx(0.25)


def test_a_correction_with_a_stated_preference_yields_a_sample_on_the_prompt_without_it(tmp_path, judge):
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app := scripted_upstream("Hi, I am Kuro. About ten minutes.")) as up:
        source = turn(store, f"{PREFERENCE}\n\nHow tall is Everest?")
        worker = run(store, judge, up.url)
        (asked,) = app.state.scripted["requests"]
    (new,) = distilled(store)
    corrected = store.get(source)
    assert corrected.reward == -1.0 and corrected.status == "ready"  # the corrected reply is never lifted
    assert asked["messages"] == [{"role": "user", "content": f"{PREFERENCE}\n\nHow long should pasta cook?"}]
    assert asked["model"] == "tiny" and asked["n"] == 1
    assert new.prompt_ids == corrected.prompt_ids  # trained on the prompt WITHOUT the correction
    assert not set(word_ids("Kuro, always introduce")) & set(new.prompt_ids)
    assert new.response_ids == [*word_ids("Hi, I am Kuro. About ten minutes."), 3]
    assert new.behaviour_logprobs == [-0.25] * len(new.response_ids)  # the hinted distribution's, as sampled
    assert new.status == "ready" and new.reward is None and new.teacher_logprobs is None
    assert new.meta.distilled["from"] == source and new.meta.distilled["preference"] == PREFERENCE
    assert new.meta.distilled["gain"] == pytest.approx(0.25)
    assert (new.session_id, new.agent_id, new.text.next_state) == (corrected.session_id, corrected.agent_id, None)
    assert worker.stats["distilled"] == 2 and worker.distiller.stats["accepted"] == 1  # the reply and the own row
    hinted_ids = prompt_ids(asked["messages"])
    assert "teacher_prompt_ids" not in new.meta.distilled  # an accepted reply: trained on its own tokens
    (mine,) = own(store)  # the corrected reply, to be pulled toward the hinted teacher's tokens
    assert mine.prompt_ids == corrected.prompt_ids and mine.response_ids == corrected.response_ids
    assert mine.meta.distilled["teacher_prompt_ids"] == hinted_ids and mine.meta.distilled["kind"] == "own"
    assert mine.status == "ready" and mine.reward is None and mine.meta.distilled["replays_left"] == REPLAYS
    monitor = HealthMonitor(str(store.path))
    monitor.attach(worker=worker)
    assert monitor.snapshot()["rollout/distilled"] == 2.0  # in the logger and `status`, like every loop counter


def test_the_same_hinted_reply_twice_is_one_row_scored_once(tmp_path, judge):
    """A short reply sampled cool often comes back more than once in the teacher's `n`: trained once (its replays
    repeat it, no more), and the teacher is not asked to score it again."""
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app := scripted_upstream("I am Kuro. About ten minutes.", answer_n=True)) as up:
        turn(store, f"{PREFERENCE}\n\nHow tall is Everest?")
        distiller = ContextDistiller(up.url, "tiny", min_gain=0.1, samples=3, temperature=None, min_relevance=None)
        worker = SeedRulesWorker(store, judge, session_idle_s=1e9, at_least_one=False, no_next_state="drop",
                                 distiller=distiller)  # fmt: skip
        asyncio.run(worker.run_once())
        (asked,) = app.state.scripted["requests"]
        scored = len(app.state.scripted["completions"])
    (new,) = distilled(store)
    assert asked["n"] == 3 and distiller.stats["duplicates"] == 2 and scored == 1  # one plain-prompt forward
    assert new.meta.distilled["gains"] == [pytest.approx(0.25)] and new.meta.distilled["replays_left"] == REPLAYS
    monitor = HealthMonitor(str(store.path))
    monitor.attach(worker=worker)
    assert monitor.snapshot()["rollout/distill_duplicates"] == 2.0  # in the logger and `status`


@pytest.mark.parametrize(
    "reaction",
    [
        "Great. Now give me a shorter version for Twitter.",
        "haha, the weather here is lovely today",
        "lovely, cheers",
        "What about rice?",
        None,
    ],
    ids=["follow-up task", "small talk", "praise", "new question", "no reaction"],
)
def test_no_sample_from_a_follow_up_praise_a_new_question_or_silence(tmp_path, judge, reaction):
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app := scripted_upstream("Hi, I am Kuro.")) as up:
        turn(store, reaction)
        run(store, judge, up.url)
        assert app.state.scripted["requests"] == []  # the teacher was never asked
    assert distilled(store) == []


def test_a_correction_without_a_stated_preference_asks_no_teacher(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app := scripted_upstream("Hi, I am Kuro.")) as up:
        source = turn(store, "Wrong.\n\nHow tall is Everest?")  # the rule judge: -1; nothing said about what is wanted
        run(store, RuleJudge(), up.url)
        assert app.state.scripted["requests"] == []
    assert distilled(store) == [] and store.get(source).meta["distill"] == {"skipped": "no stated preference"}


def test_a_reply_the_preference_does_not_explain_is_not_trained(tmp_path, judge):
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(scripted_upstream("About ten minutes.")) as up:
        source = turn(store, PREFERENCE)
        worker = run(store, judge, up.url, min_gain=0.5)  # the scripted teacher's replies gain 0.25
    assert distilled(store) == [] and worker.distiller.stats["rejected"] == 1
    assert store.get(source).meta["distill"]["accepted"] == 0 and store.get(source).reward == -1.0
    # the corrected reply still teaches, toward the teacher's tokens (their KL is small when the preference
    # changes little: the term then moves little)
    assert [s.meta.distilled["from"] for s in own(store)] == [source]


def test_without_own_reply_or_the_teachers_prompt_only_hinted_replies_are_stored(tmp_path, judge):
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(scripted_upstream("Hi, I am Kuro.")) as up:
        turn(store, PREFERENCE)
        worker = SeedRulesWorker(store, judge, session_idle_s=1e9, at_least_one=False, no_next_state="drop",
                                 distiller=ContextDistiller(up.url, "tiny", min_gain=0.1, samples=1, temperature=None,
                                                            own_reply=False))  # fmt: skip
        asyncio.run(worker.run_once())
    assert own(store) == [] and len(distilled(store)) == 1


def test_with_no_hinted_replies_the_teacher_only_renders_and_the_corrected_reply_teaches(tmp_path, judge):
    """`samples: 0`: one forward per correction (the hinted prompt rendered, one token), no generation to score."""
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app := scripted_upstream("Hi, I am Kuro.")) as up:
        source = turn(store, f"{PREFERENCE}\n\nHow tall is Everest?")
        worker = SeedRulesWorker(store, judge, session_idle_s=1e9, at_least_one=False, no_next_state="drop",
                                 distiller=ContextDistiller(up.url, "tiny", samples=0, own_reply=True))  # fmt: skip
        asyncio.run(worker.run_once())
        (asked,) = app.state.scripted["requests"]
    assert asked["max_tokens"] == 1 and asked["n"] == 1 and asked["messages"][0]["content"].startswith(PREFERENCE)
    assert distilled(store) == [] and [s.meta.distilled["from"] for s in own(store)] == [source]
    assert own(store)[0].meta.distilled["teacher_prompt_ids"] == prompt_ids(asked["messages"])
    with pytest.raises(ValueError, match="own_reply"):
        ContextDistiller(up.url, "tiny", samples=0)  # own_reply is off by default


def test_held_out_sessions_are_never_distilled(tmp_path, judge):
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app := scripted_upstream("Hi, I am Kuro.")) as up:
        turn(store, PREFERENCE, session="held")
        run(store, judge, up.url, heldout_share=0.9999)
        assert app.state.scripted["requests"] == []
    assert distilled(store) == []


def test_a_distilled_reply_with_a_secret_is_screened_like_any_turn(tmp_path, judge):
    secret = "sk-proj-" + "Ab3dE5gH7jK9mN1pQ3sT5vX7zB9cD1fG"
    store = SampleStore(tmp_path / "s.sqlite", screen=PrivacyPolicy())
    with ThreadedServer(scripted_upstream(f"I am Kuro. Your key is {secret}")) as up:
        source = turn(store, PREFERENCE)
        run(store, judge, up.url)
    (new,) = distilled(store)
    assert new.status == "dropped" and new.meta.dropped == "secret"
    assert new.response_ids == [] and secret not in (new.text.response_text or "")
    claimed = [s.id for s in store.claim_batch(0, 8)]
    assert new.id not in claimed and source in claimed  # never trained: the corrected turn (and its own row) are


def test_a_failing_teacher_is_said_and_the_turn_still_settles(tmp_path, judge):
    store = SampleStore(tmp_path / "s.sqlite")
    source = turn(store, PREFERENCE)
    worker = run(store, judge, "http://127.0.0.1:9")  # nothing listens there
    assert store.get(source).status == "ready" and store.get(source).reward == -1.0
    assert worker.stats["distill_failed"] == 1 and "error" in store.get(source).meta["distill"]
    assert distilled(store) == []


EARLIER = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello! I'm Sam."},
    {"role": "user", "content": f"{PREFERENCE}\n\nHow long should pasta cook?"},
]


def test_a_fresh_conversation_is_the_request_alone_without_the_earlier_reaction():
    assert fresh_conversation(EARLIER, 1) == [EARLIER[0], {"role": "user", "content": "How long should pasta cook?"}]
    assert fresh_conversation(QUESTION, 0) == QUESTION  # a first turn is already fresh
    one = [*EARLIER[:3], {"role": "user", "content": "Why?"}]
    assert fresh_conversation(one, 1) == [EARLIER[0], {"role": "user", "content": "Why?"}]  # no reaction to drop
    opening = [{"role": "user", "content": "Hi.\n\nHow long should pasta cook?"}]
    assert fresh_conversation(opening, 0) == opening  # a first message's paragraphs are all the request
    assert len(EARLIER) == 4 and EARLIER[3]["content"].startswith(PREFERENCE)  # a copy


@pytest.mark.parametrize(
    ("message", "asked"),
    [
        (
            "I told you, sign off as Mika. Right. Which houseplants cope with shade?",
            "Which houseplants cope with shade?",
        ),
        ("Use metric units, please.\nHow far is Lyon from Paris?", "How far is Lyon from Paris?"),
        ("Stop calling it a 'recipe'. Moving on: what wine goes with trout?", "Moving on: what wine goes with trout?"),
        ("Lovely, that's it. How do I store the leftovers?", "How do I store the leftovers?"),
        ("How do I store the leftovers?", "How do I store the leftovers?"),  # no reaction to drop
        (
            "Sign off as Mika. Draft a note to my landlord.",
            "Sign off as Mika. Draft a note to my landlord.",
        ),  # unsure: kept
    ],
)
def test_a_reaction_in_the_same_paragraph_as_the_next_request_is_left_out(message, asked):
    """One paragraph holding the reaction to the earlier reply and the next request: the fresh conversation is the
    request alone (in two runs of CLaaS identity, 18 of 57 later-turn corrections kept the person's earlier
    correction in the plain prompt this way, and 1 of those 18 was accepted). When the reader cannot tell where the
    request begins, the message is kept as it is."""
    later = [*EARLIER[:3], {"role": "user", "content": message}]
    assert fresh_conversation(later, 1) == [EARLIER[0], {"role": "user", "content": asked}]


def test_a_later_turn_is_distilled_into_a_fresh_conversation_and_trained_on_its_plain_prompt(tmp_path, judge):
    """At a later turn the prompt already holds the person's earlier correction, so the preference adds little
    there (1 of 41 later turns accepted in the real-path runs); the fresh conversation has none of it."""
    store = SampleStore(tmp_path / "s.sqlite")
    prompt = [1, *word_ids("user Hi there! assistant Hello! I'm Sam."), 2]
    with ThreadedServer(app := scripted_upstream("Hi, I am Kuro. About ten minutes.")) as up:
        words = SampleText(messages=EARLIER, response_text="Ten minutes.", next_state=f"{PREFERENCE}\n\nAnd rice?")
        later = Sample(prompt, [11, 3], [-1.0, -1.0], session_id="s1", turn_index=1, text=words)
        source = store.insert(later)
        run(store, judge, up.url)
        render, asked = app.state.scripted["requests"]
    fresh = [EARLIER[0], {"role": "user", "content": "How long should pasta cook?"}]
    assert render["messages"] == fresh and render["max_tokens"] == 1  # the plain prompt, as the teacher renders it
    hinted = {"role": "user", "content": f"{PREFERENCE}\n\nHow long should pasta cook?"}
    assert asked["messages"] == [EARLIER[0], hinted]
    (new,) = distilled(store)
    assert new.prompt_ids == prompt_ids(fresh) != store.get(source).prompt_ids  # trained on the fresh plain prompt
    assert new.text.messages == fresh and new.meta.distilled["context"] == "fresh"
    assert new.meta.distilled["replays_left"] == REPLAYS
    (mine,) = own(store)
    assert mine.prompt_ids == new.prompt_ids and mine.response_ids == [11, 3]  # the later reply, on the fresh prompt


def test_turn_context_keeps_the_conversation_as_it_happened(tmp_path, judge):
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app := scripted_upstream("Hi, I am Kuro.")) as up:
        words = SampleText(messages=EARLIER, response_text="Ten minutes.", next_state=PREFERENCE)
        source = store.insert(Sample([1, 2], [11, 3], [-1.0, -1.0], session_id="s1", turn_index=1, text=words))
        run(store, judge, up.url, context="turn")
        (asked,) = app.state.scripted["requests"]
    assert asked["messages"][:3] == EARLIER[:3]
    (new,) = distilled(store)
    assert new.prompt_ids == store.get(source).prompt_ids


def test_the_distiller_refuses_an_unknown_context_or_replay_count():
    with pytest.raises(ValueError, match="context"):
        ContextDistiller("http://127.0.0.1:9", "tiny", context="elsewhere")
    with pytest.raises(ValueError, match="replays"):
        ContextDistiller("http://127.0.0.1:9", "tiny", replays=-1)


def test_a_correction_settles_before_its_distillation_and_the_queue_is_bounded(tmp_path, judge):
    """The teacher's generation runs off the scoring path: the corrected turn is `ready` with its own score
    before the teacher is asked (under load the distiller held every score back by 6 minutes at a time)."""
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app := scripted_upstream("Hi, I am Kuro. About ten minutes.")) as up:
        source = turn(store, f"{PREFERENCE}\n\nHow tall is Everest?")
        worker = SeedRulesWorker(store, judge, session_idle_s=1e9, at_least_one=False, no_next_state="drop",
                                 distiller=ContextDistiller(up.url, "tiny", min_gain=0.1, samples=1,
                                                            temperature=None))  # fmt: skip
        asyncio.run(worker.run_once(drain_distill=False))
        assert store.get(source).status == "ready" and store.get(source).reward == -1.0
        assert store.get(source).meta["distill"] == {"queued": True} and app.state.scripted["requests"] == []
        assert asyncio.run(worker.distill_next()) and not asyncio.run(worker.distill_next())
        (new,) = distilled(store)
        assert store.get(source).meta["distill"]["accepted"] == 1 and new.meta.distilled["from"] == source
    dropped = [worker.progress.distill.push(store.get(source), PREFERENCE) for _ in range(DISTILL_BACKLOG + 3)]
    assert len(worker.progress.distill) == DISTILL_BACKLOG and dropped.count(True) == 3


def test_the_teacher_samples_cooler_than_the_turn_and_scores_under_the_turns_distribution(tmp_path, judge):
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(app := scripted_upstream("Hi, I am Kuro. About ten minutes.")) as up:
        source = turn(store, f"{PREFERENCE}\n\nHow tall is Everest?")  # sampled at T=1 (the Sample default)
        worker = run(store, judge, up.url, min_gain=-1.0, temperature=0.5)
        (asked,) = app.state.scripted["requests"]
        scored = app.state.scripted["completions"]
    assert asked["temperature"] == 0.5 and (asked["top_p"], asked["top_k"]) == (1.0, -1)  # the turn's truncation
    hinted = prompt_ids(asked["messages"])
    # two scores of the reply, both at the turn's T=1: on the plain prompt (the gain's base) and on the hinted one
    assert sorted(tuple(c["prompt"][: len(hinted)]) == tuple(hinted) for c in scored) == [False, True]
    assert {c.get("temperature", 1.0) for c in scored} == {1.0}
    (new,) = distilled(store)
    assert new.temperature == store.get(source).temperature == 1.0
    assert new.behaviour_logprobs == [-0.5] * len(new.response_ids)  # the hinted prompt's, under T=1, not as sampled
    assert new.meta.distilled["sampled_at"] == 0.5 and new.meta.distilled["gain"] == pytest.approx(0.0)
    assert worker.distiller.stats["accepted"] == 1


@pytest.mark.parametrize(("turn_t", "cool", "sampled"), [(1.0, 0.5, 0.5), (0.3, 0.5, 0.3), (1.0, None, 1.0),
                                                          (0.0, 0.5, 0.5)])  # fmt: skip
def test_the_teacher_is_never_hotter_than_the_turn(turn_t, cool, sampled):
    from metaclaw.distribution import sample_distribution

    distiller = ContextDistiller("http://127.0.0.1:9", "tiny", temperature=cool)
    assert distiller._sampling(sample_distribution(turn_t, {}))["temperature"] == sampled
    with pytest.raises(ValueError, match="temperature"):
        ContextDistiller("http://127.0.0.1:9", "tiny", temperature=0.0)


def test_the_teachers_time_follows_what_it_yields(tmp_path):
    """Full rate until a quarter of the window is in, and while at least `target_yield` of the hinted replies is
    accepted; below, busy in proportion to the yield, never less than `min_share`; the rest after a distillation
    makes the teacher busy exactly `share()` of the time. (The scripted teacher answers one reply a request.)"""
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(scripted_upstream("Hi, I am Kuro.")) as up:
        source = store.get(turn(store, PREFERENCE))
        refused = ContextDistiller(up.url, "tiny", samples=1, min_gain=10.0, temperature=None)  # gains 0.25
        for i in range(YIELD_WINDOW // 4):
            assert refused.pace.share() == 1.0 and refused.pace.rest_s(2.0) == 0.0, i  # too few replies to judge by yet
            asyncio.run(refused.distill(source, PREFERENCE))
        assert list(refused.pace.recent) == [False] * (YIELD_WINDOW // 4)
        assert refused.pace.share() == refused.pace.min_share == 0.25
        assert refused.pace.rest_s(2.0) == pytest.approx(6.0)  # 2 s busy in 8: a quarter of the time
        kept = ContextDistiller(up.url, "tiny", samples=1, min_gain=0.1, temperature=None)
        for _ in range(YIELD_WINDOW // 4):
            asyncio.run(kept.distill(source, PREFERENCE))
        assert list(kept.pace.recent) == [True] * (YIELD_WINDOW // 4)
        assert kept.pace.share() == 1.0 and kept.pace.rest_s(2.0) == 0.0
    kept.pace.recent.extend([False] * (YIELD_WINDOW - len(kept.pace.recent) + 8))  # keeps the last 64: 8 accepted
    assert kept.pace.share() == 1.0  # 8 of 64 accepted: 12.5%, at least the default target of 10%: full rate
    kept.pace.recent.extend([False] * 4)  # 4 of 64 accepted: 6.25%, under the default target of 10%
    assert kept.pace.share() == pytest.approx(0.625) and kept.pace.rest_s(1.0) == pytest.approx(0.6)
    always = ContextDistiller(up.url, "tiny", target_yield=None)
    always.pace.recent.extend([False] * YIELD_WINDOW)
    assert always.pace.share() == 1.0
    with pytest.raises(ValueError, match="target_yield"):
        ContextDistiller(up.url, "tiny", target_yield=0.0)


def test_a_teacher_that_yields_little_rests_between_distillations(tmp_path, judge):
    """The background loop (`ScoringWorker.start`) rests after each distillation of a teacher whose replies are
    refused, and says so (`distill_rest_s`, `rollout/distill_share` in `status`)."""
    store = SampleStore(tmp_path / "s.sqlite")
    with ThreadedServer(scripted_upstream("Hi, I am Kuro.", delay_s=0.0)) as up:
        distiller = ContextDistiller(up.url, "tiny", samples=1, min_gain=10.0, temperature=None)
        distiller.pace.recent.extend([False] * YIELD_WINDOW)  # nothing accepted of late: a quarter of the time
        worker = SeedRulesWorker(store, judge, session_idle_s=1e9, at_least_one=False, no_next_state="drop",
                                 distiller=distiller, poll_s=0.05)  # fmt: skip
        for i in range(3):
            turn(store, f"{PREFERENCE}\n\nHow tall is Everest?", session=f"s{i}")
        worker.start()
        try:
            for _ in range(400):
                if worker.stats["distill_rest_s"] > 0:
                    break
                threading.Event().wait(0.05)
        finally:
            worker.stop()
    assert distiller.stats["asked"] >= 1 and worker.stats["distill_rest_s"] > 0
    monitor = HealthMonitor(str(store.path))
    monitor.attach(worker=worker)
    assert monitor.snapshot()["rollout/distill_share"] == 0.25
