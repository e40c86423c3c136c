"""The cheap quality signals (no server): junk replies and diversity."""

from __future__ import annotations

import pytest

from metaclaw.evaluation.quality import fluency, is_junk, text_stats


@pytest.mark.parametrize(
    ("reply", "junk"),
    [
        ("", True),
        ("  ...!!  ", True),
        ("the the the the the", True),
        ("A world of chaos is yours", False),
        ("Boil the pasta for 10 minutes, then drain it.", False),
        ("Yes.", False),
    ],
)
def test_junk_is_empty_or_repetitive(reply, junk):
    assert is_junk(reply) is junk


def test_text_stats_see_the_same_reply_everywhere():
    varied = text_stats(["Paris is the capital.", "Boil it for ten minutes.", "Use a map."])
    same = text_stats(["You're a helpful AI. What?"] * 3)
    assert varied.distinct_replies == 1.0 and varied.distinct_2 == 1.0 and varied.junk == 0.0
    assert same.distinct_replies == pytest.approx(1 / 3) and same.distinct_2 == pytest.approx(1 / 3)


def test_fluency_good_needs_compliance_and_an_nll_within_the_margin():
    nlls, compliant = [1.5, 2.5, 4.0, None], [True, True, True, False]
    assert fluency(nlls, compliant, None, 1.0) == {"nll": pytest.approx(8.0 / 3)}  # no reference yet
    out = fluency(nlls, compliant, reference=2.0, margin=1.0)
    assert out["nll_threshold"] == 3.0
    assert out["fluent"] == 0.5 and out["good"] == 0.5  # 4.0 is past the threshold; an empty reply never fluent
    assert fluency(nlls, [False] * 4, 2.0, 1.0)["good"] == 0.0
