"""Collapse onto a stock phrase (issue 42): the most common opening, the openings' entropy, self-ROUGE-L."""

from __future__ import annotations

import math

import pytest

from metaclaw.evaluation.collapse import collapse_stats, opening, rouge_l


def test_rouge_l_by_hand():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    # LCS of "a b c d" and "a c d e" is "a c d" (3): precision 3/4, recall 3/4
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)
    assert rouge_l("", "a") == 0.0 and rouge_l("x y", "z w") == 0.0


def test_opening_is_the_first_sentence_cut_to_five_words():
    assert opening("I'm Kuro! How can I help you today?") == "i'm kuro"
    assert opening("Hello there, my name is Kuro and I help.\nMore.") == "hello there my name is"
    assert opening("   ") == ""


def test_a_stock_phrase_shows_and_varied_replies_do_not():
    stock = collapse_stats([["I'm Kuro! Ask away."] * 3, ["I'm Kuro! Ask away."] * 3])
    assert stock.top_opening == "i'm kuro" and stock.top_opening_share == 1.0
    assert stock.opening_entropy == 0.0 and stock.self_rouge_l == 1.0
    varied = collapse_stats([["Hi, I'm Kuro, a helper.", "Kuro here: what do you need?"],
                             ["My name is Kuro.", "You can call me Kuro, nice to meet you."]])  # fmt: skip
    assert varied.top_opening_share == 0.25 and varied.opening_entropy == pytest.approx(math.log2(4))
    assert varied.self_rouge_l < 0.5
    assert collapse_stats([["one"], ["two"]]).self_rouge_l is None  # no prompt with two replies
    with pytest.raises(ValueError):
        collapse_stats([[]])
