"""Whether an output gives an answer (`eval/answers.py`), by hand-made outputs."""

import pytest

from oasiskv.eval.answers import match_answer, numbers_in


def test_match_answer_rules():
    assert numbers_in("a 48,213 b 1 234 567; c 12, 345678.") == ["48213", "1234567", "12",
                                                                "345678"]
    assert match_answer("48213", "key:48213,") and not match_answer("48213", "482130")
    assert match_answer("Darcy", "It was mr. darcy!") and not match_answer("Darcy", "Bingley")
    assert match_answer("darcy", "Darcy.", rule="exact")
    with pytest.raises(ValueError):
        match_answer("1", "1", rule="fuzzy")


def test_separators_do_not_join_numbers_that_are_not_grouped():
    assert numbers_in("1,2345 and 12.5") == ["1", "2345", "12", "5"]
    assert match_answer("7654321", "the number 7,654,321.") and match_answer(
        "7654321", "7 654 321", rule="exact")
