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


# Session 17: grammar that the first rules missed (each list is read wrongly on main `c7e0094`). None of these
# phrasings is in a labelled set or the prototypes (`test_new_phrasings_are_in_no_labelled_set`).
CHALLENGES = ["Why all the acronyms?", "Why are you quoting prices in yen?", "Is a week really enough for this?",
              "Huh?", "meh. who is that aimed at?"]  # fmt: skip
CANNOT_USE = ["I don't know what a mutex is.", "I have no background in law.", "You lost me there."]
NAMED_ERRORS = ["The second query has a typo in it.", "You only listed one supplier."]
COMMANDS = ["Start with the conclusion.", "Talk to me like a colleague.", "Put the totals at the bottom.",
            "I have to present this, so trim it.", "Decimals please."]  # fmt: skip
SUGGESTIONS = ["Maybe open with the key figure?", "Could you begin with the cost?", "A short intro would help.",
               "Your answer should mention the cost.", "you could be friendlier"]  # fmt: skip
ABOUT_THE_REPLY = ["How long would that take?", "What does 'memoize' mean?", "Any risks?",
                   "What other venues are there?", "I earn 900 a month, is that a realistic plan?"]  # fmt: skip
NOT_COMMANDS = ["solid work", "Top notch.", "now we're getting somewhere", "Help me write a eulogy."]
OWN_SLIPS = ["Sorry, the meeting is at 3, not 2.", "Oops, the file is on the D drive."]


def test_objections_in_more_grammar():
    said = CHALLENGES + CANNOT_USE + NAMED_ERRORS + COMMANDS + SUGGESTIONS + ABOUT_THE_REPLY
    assert [s for s in said if objection(s) is None] == []
    assert [s for s in CHALLENGES + NAMED_ERRORS if objection(s) != "strong"] == []
    assert objection("Please go by your first name from here on.") == "strong"  # a rule for later


def test_fragments_praise_and_own_slips_are_no_objection():
    assert [s for s in NOT_COMMANDS + OWN_SLIPS if objection(s) is not None] == []
    assert all(update(s) for s in OWN_SLIPS)
    assert not update("Sorry, I don't follow.") and objection("Sorry, I don't follow.") is not None


def test_new_phrasings_are_in_no_labelled_set():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [*root.glob("bench/data/reactions*.jsonl"), root / "src/metaclaw/scoring/reaction_prototypes.jsonl"]
    seen = {json.loads(line)["text"].casefold() for f in files for line in f.read_text().splitlines() if line.strip()}
    mine = CHALLENGES + CANNOT_USE + NAMED_ERRORS + COMMANDS + SUGGESTIONS + ABOUT_THE_REPLY + NOT_COMMANDS + OWN_SLIPS
    mine += SELF_REPAIRS + FOLLOW_UP_QUESTIONS + STILL_CORRECTIONS  # session 24's, defined below
    assert [s for s in mine if s.casefold() in seen] == []


def test_the_reader_reads_the_new_grammar(judge):
    corrections = [*CHALLENGES, *CANNOT_USE, *COMMANDS, *SUGGESTIONS[:2], *ABOUT_THE_REPLY,
                   "Reads like a manual. Speak plainly to me."]  # a brief remark does not end the reading  # fmt: skip
    assert [t for t, v in zip(corrections, _verdicts(judge, corrections), strict=True) if v != -1] == []
    # after words of praise, a request that edits nothing is new work; one that edits the reply corrects it
    thanked = ["Thanks! Can you give me a packing list for it?", "Cool. Also book a table for two."]
    assert _verdicts(judge, thanked) == [1.0, 1.0]
    assert _verdicts(judge, ["Thanks! Could you make it less formal?"]) == [-1.0]
    assert [v for v in _verdicts(judge, OWN_SLIPS + ["Help me write a eulogy."]) if v < 0] == []


# Session 24: self-repairs and follow-up questions that today's main read as corrections (-1). None is in a labelled
# set (`test_new_phrasings_are_in_no_labelled_set` checks).
SELF_REPAIRS = ["I should have said it's a diesel.", "I left out that my landlord pays the water bill.",
                "Scratch that, the party moved to Sunday.", "To be more specific, it's the upstairs bathroom.",
                "Turns out my passport expires in May.", "Hmm, I typed the year wrong, it's 1998.",
                "Ah wait, our garage has no power socket.", "Heads up, my brother is joining us."]  # fmt: skip
FOLLOW_UP_QUESTIONS = ["What should I bring to that?", "How do I explain this to my landlord?",
                       "Could you draft a text message about it?", "Could you make a rota from that?"]  # fmt: skip
STILL_CORRECTIONS = ["By the way, your total is wrong.", "Actually, I need it in metric.",
                     "How long does this take?", "Could you make that shorter?"]  # fmt: skip


def test_a_self_repair_is_an_update_unless_it_objects_to_the_reply():
    assert [s for s in SELF_REPAIRS if not update(s)] == []
    assert [s for s in STILL_CORRECTIONS if update(s)] == []


def test_the_reader_reads_self_repairs_and_follow_up_questions_as_no_verdict(judge):
    no_verdict = SELF_REPAIRS + FOLLOW_UP_QUESTIONS
    assert [t for t, v in zip(no_verdict, _verdicts(judge, no_verdict), strict=True) if v == -1] == []
    assert [t for t, v in zip(STILL_CORRECTIONS, _verdicts(judge, STILL_CORRECTIONS), strict=True) if v != -1] == []
