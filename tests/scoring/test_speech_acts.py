"""Issue 42: reactions in anyone's words. The kind-free speech acts (`scoring.speech_acts`) and the reader built on
them: a question or a stated need that objects to the reply is a correction, a follow-up task is not, an update of
the person's own request is no verdict. The phrasings are neither the prototypes' nor the labelled sets'; today's
main reads the reader's cases below wrongly (a question as no reaction, a follow-up task as a correction)."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from metaclaw.config import CONFIG_DIR
from metaclaw.scoring.speech_acts import follow_up, objection, update

OBJECTING_QUESTIONS = ["Citation?", "Why did you pick the most expensive hotel?", "And the side effects though?",
                       "Didn't you read my message?", "Where's the summary table?"]  # fmt: skip
STATED_NEEDS = ["I need this to fit on one slide.", "You ignored the deadline I gave.", "This isn't what I use."]
FOLLOW_UPS = ["Now write the same for the sales team.", "Also draft a short reply to Tom.",
              "Could you send a version for my manager as well?", "Next, plan the second day."]  # fmt: skip
UPDATES = ["Oops, I meant 2025, not 2024.", "I forgot to mention it's a rental car.", "My bad, the budget is 80."]
NEW_QUESTIONS = ["How do I centre a div?", "Why is the sky blue?", "Can you recommend a thriller?"]


def test_objections_in_words_of_no_kind():
    assert [s for s in OBJECTING_QUESTIONS + STATED_NEEDS if objection(s) is None] == []
    assert [s for s in NEW_QUESTIONS if objection(s, new_content=s.startswith("Can")) is not None] == []


def test_a_follow_up_task_and_an_update_are_no_objection():
    assert all(follow_up(s) and objection(s) is None for s in FOLLOW_UPS)
    assert all(update(s) and objection(s) is None for s in UPDATES)
    assert not follow_up("Now make it shorter.") and objection("Now make it shorter.") == "weak"  # an edit
    assert not follow_up("Next time, cite the paper.") and objection("Next time, cite the paper.") == "strong"


@pytest.fixture(scope="module")
def judge():
    return instantiate(OmegaConf.load(CONFIG_DIR / "judge" / "reactions.yaml"))


def _verdicts(judge, texts: list[str]) -> list[float]:
    return [r.verdict for r in judge.classifier.classify_many(texts)]


def test_the_reader_reads_questions_and_needs_as_corrections(judge):
    texts = OBJECTING_QUESTIONS + STATED_NEEDS + ["Citation? Also, when was it published?"]
    assert [t for t, v in zip(texts, _verdicts(judge, texts), strict=True) if v != -1] == []


def test_the_reader_never_reads_a_follow_up_task_as_a_correction(judge):
    praised = [f"Great, thanks. {s}" for s in FOLLOW_UPS] + ["Perfect. Now a shorter one for Instagram."]
    assert _verdicts(judge, praised) == [1.0] * len(praised)
    assert [v for v in _verdicts(judge, FOLLOW_UPS + UPDATES) if v < 0] == []
    assert _verdicts(judge, ["Great, now make it shorter.", "Thanks. Next time cite the paper."]) == [-1.0, -1.0]
