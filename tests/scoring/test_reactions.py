"""The reaction classifier (the CPU judge): clear cases of each class, low confidence, hints, the default judge
selection, and the labelled bench set (size, labels, no overlap with the prototypes)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from metaclaw.config import CONFIG_DIR
from metaclaw.scoring.judges import LLMJudge, RuleJudge, select_judge
from metaclaw.scoring.reactions import LABELS, ReactionClassifier, ReactionJudge, load_prototypes
from metaclaw.simulate.preferences import Violation
from metaclaw.simulate.user import feedback
from metaclaw.store import Sample, SampleText

REPO = Path(__file__).resolve().parents[2]
CONF = CONFIG_DIR
BENCH_SET = REPO / "bench" / "data" / "reactions.jsonl"


@pytest.fixture(scope="session")
def judge() -> ReactionJudge:
    """The default reaction judge; its encoder loads once per process (`shared_classifier`)."""
    cfg = OmegaConf.load(CONF / "judge" / "reactions.yaml")
    return instantiate(cfg)


def turn(next_state: str | None) -> Sample:
    msgs = [{"role": "user", "content": "How far is it from Paris to Lyon?"}]
    return Sample(
        [1, 2], [3], [-0.1], text=SampleText(messages=msgs, response_text="About 465 km.", next_state=next_state)
    )


def reward(judge: ReactionJudge, text: str | None) -> float:
    return asyncio.run(judge.reward(turn(text))).reward


CLEAR = [
    ("Thank you, that answered it perfectly.", 1),
    ("Great, exactly what I needed!", 1),
    ("Super, vielen Dank dafür!", 1),
    ("Hmm, I'd prefer the short version first next time, please.", -1),  # polite, none of the regex's words
    ("Could you leave out the background and just give me the figure?", -1),
    ("No, Lyon is much closer than that.", -1),
    ("Non, c'est trop long, je voulais juste le chiffre.", -1),
    ("How do I make a sourdough starter?", 0),
    ("What's the population of Lyon?", 0),
    ("Thanks!\n\nNext question: why does my build fail with a linker error?", 1),  # the reaction comes first
]


@pytest.mark.parametrize(("text", "label"), CLEAR)
def test_clear_reactions(judge, text, label):
    assert reward(judge, text) == label


def test_the_regex_misses_a_polite_correction_the_classifier_reads(judge):
    text = "Hmm, I'd prefer the short version first next time, please."
    assert asyncio.run(RuleJudge().reward(turn(text))).reward == 0.0 and reward(judge, text) == -1.0


def test_the_simulated_users_words_keep_their_verdict_and_hint(judge):
    v = Violation("max_words", "Your reply had 48 words", "Keep your reply under 20 words.")
    corrected = feedback([v], "How tall is Mount Everest?")
    assert reward(judge, corrected) == -1.0 and reward(judge, feedback([], "How tall is Mount Everest?")) == 1.0
    assert reward(judge, feedback([v])) == -1.0 and reward(judge, feedback([])) == 1.0
    hint = asyncio.run(judge.hint(turn(corrected)))
    expected = "Your reply had 48 words. Keep your reply under 20 words."
    assert hint == asyncio.run(RuleJudge().hint(turn(corrected))) == expected


def test_hint_is_the_correction_without_the_next_question(judge):
    polite = "Hmm, I'd prefer the short version first next time, please."
    assert asyncio.run(judge.hint(turn(polite))) == polite
    mixed = "That's not it. Please give distances in miles. Also, how long is the drive?"
    assert asyncio.run(judge.hint(turn(mixed))) == "Please give distances in miles."
    assert asyncio.run(judge.hint(turn("Thanks, perfect."))) is None
    assert asyncio.run(judge.hint(turn(None))) is None


def test_no_next_state_and_verdict_detail(judge):
    assert reward(judge, None) == 0.0
    detail = asyncio.run(judge.reward(turn("No, Lyon is much closer than that."))).detail
    assert detail["rule"] in ("negative", "objection") and detail["judge"] == "reactions"
    assert 0.5 <= detail["confidence"] <= 1


def test_low_confidence_is_no_reaction(judge):
    clf = judge.classifier
    neg, neu, pos = (LABELS.index(c) for c in (-1, 0, 1))
    weak = np.zeros((2, 3))
    weak[:, neg], weak[:, neu], weak[:, pos] = 0.45, 0.3, 0.25  # leaning to a correction, below the threshold
    r = clf._decide([(["Hmm.", "Hmm"], weak)])
    assert (r.verdict, r.reason) == (0.0, "low_confidence") and r.confidence == pytest.approx(0.45)
    sure = weak.copy()
    sure[1, neg], sure[1, neu] = 0.6, 0.15
    assert clf._decide([(["Hmm. No", "No"], sure)]).verdict == -1.0
    assert clf.threshold == 0.5  # the stated threshold (conf/judge/reactions.yaml)


def test_a_confident_correction_wins_over_thanks_in_the_same_paragraph(judge):
    assert reward(judge, "Thanks, but you gave it in miles and I need kilometres.") == -1.0


def test_classification_is_deterministic_and_batched(judge):
    texts = [t for t, _ in CLEAR]
    clf = judge.classifier
    clf._cache.clear()
    first = clf.classify_many(texts)
    clf._cache.clear()
    again = [clf.classify(t) for t in texts]  # one at a time: other batch padding, same verdicts
    assert [(r.verdict, r.reason) for r in again] == [(r.verdict, r.reason) for r in first]
    assert [r.confidence for r in again] == pytest.approx([r.confidence for r in first], abs=1e-4)


def test_an_encoder_that_cannot_load_fails_loudly(tmp_path):
    with pytest.raises(RuntimeError, match="judge=rule or judge=llm"):
        ReactionClassifier(model_dir=tmp_path)


def test_auto_picks_the_reaction_judge_for_models_that_cannot_judge(tmp_path, judge):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for model in ("tiny", "smollm2_135m"):
            cfg = compose("train", overrides=[f"model={model}", f"run_dir={tmp_path}"])
            assert isinstance(instantiate(cfg.judge), ReactionJudge), model
        cfg = compose("train", overrides=["model=tiny", f"run_dir={tmp_path}", "judge=rule"])
        assert isinstance(instantiate(cfg.judge), RuleJudge)


def test_auto_builds_only_the_chosen_judge():
    broken = {"_target_": "metaclaw.scoring.reactions.ReactionJudge", "model_dir": "/nonexistent"}
    llm = {"_target_": "metaclaw.scoring.judges.LLMJudge", "base_url": "http://127.0.0.1:9", "model": "qwen"}
    chosen = select_judge("qwen", ["tiny"], OmegaConf.create(broken), OmegaConf.create(llm))
    assert isinstance(chosen, LLMJudge)  # the classifier's encoder was never loaded for a real judge model
    with pytest.raises(Exception, match="cannot load its sentence encoder"):  # noqa: B017 - Hydra wraps it
        select_judge("tiny", ["tiny"], OmegaConf.create(broken), OmegaConf.create(llm))


def _tokens(text: str) -> set[str]:
    return set(re.findall(r"\w+|[^\w\s!-/:-@\[-`{-~]", text.casefold()))


def test_the_labelled_set_is_large_varied_and_disjoint_from_the_prototypes():
    rows = [json.loads(line) for line in BENCH_SET.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) >= 300
    assert {r["label"] for r in rows} == {-1, 0, 1} and all(isinstance(r["text"], str) for r in rows)
    assert {"terse", "polite", "sarcastic", "typo", "non_english", "emoji", "hedge", "mixed_topic"} <= {
        r["style"] for r in rows
    }
    assert len({r["text"] for r in rows}) == len(rows)
    prototypes = [t for t, _ in load_prototypes()]
    for r in rows:  # no prototype, nor a near copy of one (more than 60% shared words / emoji)
        a = _tokens(r["text"])
        for p in prototypes:
            b = _tokens(p)
            assert len(a & b) / max(1, len(a | b)) < 0.6, (r["text"], p)


# ---- Issue 24: on the real path a person reacts inside their next message, joined to the next question, in their
# own words. The phrasings below are ours (neither people.yaml's nor the labelled set's).

RUN_ON = [  # a reaction typed without a full stop ends where a capitalised question or change of subject begins
    ("nicely done Next: what is the capital of Peru?", 1),
    ("brilliant stuff Anyway. What is a good name for a goldfish?", 1),
]
WISHES = [  # a wish restated as unmet, right after the reply, is a correction
    ("I need them sorted by date.", -1),
    ("I was looking for something I can cook in ten minutes.", -1),
    ("Thank you, but I was after the weekend timetable.", -1),
]
CONTRASTS = [  # praise, then "but/though ..." that is not praise: the stance is the second half's
    ("Helpful, but a bit heavy on theory for a beginner like me.", -1),
    ("Thanks! Unrelated, but how do I clean a cast iron pan?", 1),  # a new question after "but" is no complaint
    ("I wanted exactly this, thanks!", 1),  # a wish met is no wish restated
]


@pytest.mark.parametrize(("text", "label"), RUN_ON + WISHES + CONTRASTS)
def test_people_reactions_in_their_own_words(judge, text, label):
    assert reward(judge, text) == label


def test_a_run_on_reaction_is_split_from_the_next_question():
    from metaclaw.scoring.reactions import reaction_head, sentences

    assert sentences("superb, cheers How do I descale a kettle?") == ["superb, cheers", "How do I descale a kettle?"]
    assert sentences("Thanks, but what about Lyon?") == ["Thanks, but what about Lyon?"]  # a name asks nothing
    sents = sentences("Bullets next time. Anyway. Another one: why is the sea salty?")
    assert reaction_head(sents) == "Bullets next time. Anyway."


def test_a_correction_joined_to_the_next_question_is_never_an_approval(judge):
    from metaclaw.simulate.people import JOINERS

    corrections = ["Helpful, but a bit heavy on theory for a beginner like me.", "I need them sorted by date.",
                   "Thank you, but I was after the weekend timetable.", "kinda bland tbh, be bolder"]  # fmt: skip
    texts = [c + j + "How long do I steam broccoli?" for c in corrections for j in JOINERS] + corrections
    assert [t for t, r in zip(texts, judge.classifier.classify_many(texts), strict=True) if r.verdict > 0] == []


def _probs(*rows: tuple[float, float, float]) -> np.ndarray:
    """Rows of (correction, none, approval) probabilities in `LABELS` order."""
    assert LABELS == (-1, 0, 1)
    return np.array(rows)


def test_an_approval_needs_a_sentence_of_the_first_paragraph_above_the_approval_threshold(judge):
    clf = judge.classifier
    two = ["Reads fine. Bold, though.", "Reads fine.", "Bold, though."]
    summed = _probs((0.1, 0.2, 0.7), (0.3, 0.25, 0.45), (0.3, 0.3, 0.4))  # only the two sentences together
    assert clf._decide([(two, summed)]).verdict == 0.0
    weak = _probs((0.2, 0.28, 0.52))  # above `threshold`, below `approval`
    assert clf._decide([(["Bold."], weak)]).verdict == 0.0
    sure = _probs((0.05, 0.05, 0.9))
    assert clf._decide([(["Bold."], sure)]).verdict == 1.0
    later = [(["Hmm."], _probs((0.1, 0.85, 0.05))), (["Lovely!"], sure)]  # the second paragraph is a new ask
    assert clf._decide(later).verdict == 0.0
    assert clf.approval == 0.55 > clf.threshold  # the stated settings (conf/judge/reactions.yaml)


def test_a_fragment_read_as_a_correction_inside_an_approval_is_no_verdict(judge):
    clf = judge.classifier
    segs = ["Tables, great.", "Tables", "great."]
    probs = _probs((0.1, 0.1, 0.8), (0.6, 0.3, 0.1), (0.05, 0.05, 0.9))  # the bare noun alone reads as a request
    assert (clf._decide([(segs, probs)]).verdict, clf._decide([(segs, probs)]).reason) == (0.0, "mixed")
    contrast = ["Great, but tables.", "Great", "but tables."]  # after "but" the fragment is the point
    assert clf._decide([(contrast, probs)]).verdict == -1.0
    assert reward(judge, "Citations included, great work.") >= 0  # never trained as a correction


# ---- Issue 24, form and praise: on the real path a person asks right after a reply for another FORM of it
# (length, order, directness, person, tone, format, language) and praises a reply by naming what was right. The
# phrasings are ours (neither people.yaml's nor the labelled set's); each list has cases today's main misread.

FORM_REQUESTS = [  # a request about HOW to answer, right after the reply: a correction of that reply
    'Could you address me as "you" when you explain?',
    "Can you give me the total first?",
    "Put the key figure at the top, thanks.",
    "Use a table for this kind of thing.",
    "Can you lead with the price?",
    "ok but more direct",
    "Say it in one sentence.",
    "next time lead with the recommendation",
    'Use "you" when you talk to me.',
    "great, now make it shorter",  # praise, then a command about the form
    "Nächstes Mal bitte zuerst die Zahl.",
    "La prochaine fois, commence par le résumé.",
    "La próxima vez ponme la respuesta primero.",
    "Can you give me the total first? How do I get to Lyon by train?",  # then the next question
]
NEW_CONTENT = [  # a request about new CONTENT stays no reaction, even when it names a form
    "Now tell me about the Roman Empire.",
    "What about Madrid?",
    "Can you give me a list of rivers in Spain?",
    "Write a short poem about autumn.",
    "Write a formal letter to my landlord.",
    'Translate "good morning" into German.',
    "Give me a table of the planets and their moons.",
    "How long does it take to boil an egg? Keep it short.",  # the form asked for is the next reply's
]
FEATURE_PRAISE = [  # praise that names what was right: the feature named alone reads like a request
    "Great, bullets next time too.",
    "Perfect, number first, exactly how I like it.",
    "brilliant, no fluff at all",
    "Good, you spoke to me directly this time.",
    "Nice — you led with the summary.",
    "great, one line is all I needed",
    "Genau so, kurz und direkt. Danke!",
    "Genial, directo al grano.",
]
NOT_PRAISE = [  # praise words that do not praise: a contrast, excess, sarcasm, a form request after praise
    "Perfect, if I wanted an essay.",
    "Nice, but too long.",
    "Good answer, a bit long though.",
    "Thanks, but could you put the number first?",
    "Good. Shorter next time though.",
]


def _misread(judge: ReactionJudge, texts: list[str], label: int) -> list[tuple[str, float]]:
    return [
        (t, r.verdict) for t, r in zip(texts, judge.classifier.classify_many(texts), strict=True) if r.verdict != label
    ]


def test_a_request_about_the_replys_form_is_a_correction(judge):
    assert _misread(judge, FORM_REQUESTS, -1) == []
    # read by the kind-free speech acts first (a polite request with a verb of phase), by the form rule where they pass
    assert judge.classifier.classify("Can you lead with the price?").reason in {"objection", "form"}


def test_a_request_for_new_content_is_no_reaction_even_when_it_names_a_form(judge):
    assert _misread(judge, NEW_CONTENT, 0) == []
    assert _misread(judge, ["Can you give me the total first?"], -1) == []  # the same frame, about the reply


def test_praise_that_names_the_feature_is_an_approval(judge):
    assert _misread(judge, FEATURE_PRAISE, 1) == []
    assert judge.classifier.classify("Genial, directo al grano.").reason == "praise_feature"


def test_praise_words_that_do_not_praise_are_never_an_approval(judge):
    assert _misread(judge, NOT_PRAISE, -1) == []


def test_form_and_praise_rules_read_sentences_in_general_terms():
    from metaclaw.scoring.reactions import form_request, praises_feature

    assert form_request("Next time, shorter.") and form_request("Could you put the verdict up front?")
    assert not form_request("Write me a short story about a fox.") and not form_request("Same format next time.")
    assert not form_request("Nice, you kept it in bullets.")  # a description, not a request
    assert praises_feature("Lovely, the steps are numbered.") and praises_feature("The table is perfect.")
    assert not praises_feature("Great, another wall of text.") and not praises_feature("Nice, but shorter?")
    assert not praises_feature("Explain why the sky is blue.")
    assert not praises_feature('Lovely, your "short" answer filled my whole screen.')  # quoted back: sarcasm
    assert not praises_feature("Great, a ten-step guide for something that takes one click.")  # more than a feature


def test_sentences_keep_decimals_and_ellipses_and_a_wish_reads_with_an_apostrophe():
    from metaclaw.scoring.reactions import WISH, sentences

    assert sentences("Hmm... shorter. It costs 3.5 euros. Really?! Ok") == [
        "Hmm...",
        "shorter.",
        "It costs 3.5 euros.",
        "Really?!",
        "Ok",
    ]  # old main: "Hmm.", ".", ".", ..., "It costs 3.", "5 euros."
    assert WISH.match("I'd like it in metric units.") and WISH.match("I’d prefer them sorted by size.")
    assert not WISH.match("I'd like to know how tides work.")  # a new ask, not a wish restated


def test_the_hint_of_a_form_request_keeps_its_short_first_sentence(judge):
    text = "Briefer, please. And put the total first."
    assert reward(judge, text) == -1.0
    assert asyncio.run(judge.hint(turn(text))) == text  # old main dropped "Briefer, please." as a bare verdict
    assert asyncio.run(judge.hint(turn("No, that's wrong. Lyon is 465 km away."))) == "Lyon is 465 km away."
