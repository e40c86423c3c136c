"""The one-forward verdict judge (`judge=verdict`, issue 42): a verdict from the judge model's probabilities of
three letters at one position, through a real policy server's `top_logprobs`."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest

from metaclaw.scoring.verdict import VerdictJudge, letter_shares
from metaclaw.store import Sample, SampleText
from tests.serving.conftest import running_server


def top(**probs: float) -> list[dict]:
    return [{"token": token, "logprob": math.log(p)} for token, p in probs.items()]


def test_letters_count_whatever_their_case_and_spacing():
    shares, mass = letter_shares([*top(A=0.3, B=0.1), {"token": " a", "logprob": math.log(0.2)},
                                  {"token": "Sure", "logprob": math.log(0.3)}])  # fmt: skip
    assert mass == pytest.approx(0.6) and shares["A"] == pytest.approx(5 / 6) and shares["C"] == 0.0


@pytest.mark.parametrize(
    ("probs", "reward", "rule"),
    [
        (dict(A=0.7, B=0.1, C=0.1), -1.0, "A"),  # objects: a correction
        (dict(A=0.05, B=0.8, C=0.1), 1.0, "B"),  # approves
        (dict(A=0.1, B=0.1, C=0.7), 0.0, "C"),  # neither: a new question, a follow-up task
        (dict(A=0.4, B=0.35, C=0.2), 0.0, "unsure"),  # no letter holds min_share of the mass
    ],
)
def test_the_verdict_is_the_letter_that_holds_most_of_the_mass(probs, reward, rule):
    verdict = VerdictJudge("http://127.0.0.1:9", "judge").decide(top(**probs))
    assert verdict.reward == reward and verdict.detail["rule"] == rule


def test_a_model_that_ignores_the_format_gives_no_verdict_and_says_so(caplog):
    judge = VerdictJudge("http://127.0.0.1:9", "judge")
    with caplog.at_level(logging.WARNING, logger="metaclaw.scoring.verdict"):
        verdict = judge.decide(top(Hello=0.6, A=0.05, B=0.04))
    assert verdict.reward == 0.0 and verdict.detail["rule"] == "off_format" and "0.5B" in caplog.text


def test_one_forward_through_a_real_policy_server(tmp_path_factory):
    """The whole path on `serve.py model=tiny`: one chat request of one token with top_logprobs; the random tiny
    model puts its mass anywhere, so the judge reads it and (at its mass) gives a verdict or none, never an error."""
    turn = Sample([1, 2], [3], [-1.0], text=SampleText(
        messages=[{"role": "user", "content": "How long should pasta cook?"}], response_text="About ten minutes.",
        next_state="No, I asked about rice. Please answer what I ask."))  # fmt: skip
    with running_server(tmp_path_factory.mktemp("serve"), tmp_path_factory.mktemp("adapters")) as live:
        judge = VerdictJudge(live.url, "tiny", live.api_key, min_mass=0.0)
        verdict = asyncio.run(judge.reward(turn))
    assert verdict.detail["judge"] == "verdict" and 0 <= verdict.detail["mass"] <= 1
    assert set(verdict.detail["letters"]) == {"A", "B", "C"} and verdict.reward in (-1.0, 0.0, 1.0)
    assert asyncio.run(judge.hint(turn)) == turn.text.next_state  # what the person said they want
    none = Sample([1], [2], [-1.0], text=SampleText(messages=[], response_text="x", next_state=None))
    assert asyncio.run(judge.reward(none)).detail["rule"] == "no_next_state"
