"""The cheap quality signals (no server): junk replies and diversity."""

from __future__ import annotations

import pytest

from metaclaw.evaluation.quality import is_junk, text_stats


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
