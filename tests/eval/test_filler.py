"""The fidelity tasks' filler (`eval/filler.py`): boundaries, where filler starts, trimming and
insertion, against hand-written texts."""

import random

import pytest

from oasiskv.eval.filler import (
    clause_ends,
    filler_start,
    insert,
    sentence_ends,
    snap,
    source,
    trim,
    unwrap,
)


def test_sentence_ends_skip_abbreviations():
    text = 'Mrs. Allen said so. Mr. J. Thorpe came! "Did he?" she asked.\n\nYes.'
    ends = sentence_ends(text)
    assert [text[:e][-6:] for e in ends[1:-1]] == ["id so.", " came!", 'd he?"',
                                                   "ked.\n\n"]  # a new paragraph
    clauses = clause_ends("One, two; three: four")
    assert clauses == [0, 4, 9, 16, 21]


def test_paragraph_breaks_are_sentence_ends_after_the_blank_line():
    rng = random.Random(1)
    for _ in range(200):  # unwrapped prose: sentences, clauses, single blank lines
        text = unwrap("".join(rng.choice(["Mr. Darcy", " came", ", then", ". She", "!", "\n",
                                          "\n\n", " left."]) for _ in range(12))).strip()
        ends = set(sentence_ends(text))
        i = text.find("\n\n")
        while i >= 0:  # the reference: every "\n\n" by hand
            assert i + 2 in ends and i not in ends, (text, i)
            i = text.find("\n\n", i + 2)


TEXT = "First para.\n\nSecond one\nwrapped.\n\n\nThird."  # S at 13, T at 35


@pytest.mark.parametrize("offset, want", [
    (0, 0), (-3, 0),            # the start of the text
    (1, 13), (11, 13),          # in the first paragraph, at its blank line
    (13, 35), (20, 35),         # at the second paragraph's first character: the next one
    (33, 35),                   # inside the third's blank line (three newlines)
    (34, 0), (35, 0), (50, 0),  # no blank line begins at or after it: wraps to the start
])
def test_filler_starts_at_the_next_paragraph_break(offset, want):
    assert TEXT[13] == "S" and TEXT[35] == "T"
    assert filler_start(TEXT, offset) == want


def old_filler_start(text: str, offset: int) -> int:
    """The filler's own search before it used data/'s paragraph_start (the reference)."""
    if offset <= 0:
        return 0
    i = text.find("\n\n", offset)
    if i < 0:
        return 0
    while i < len(text) and text[i] == "\n":
        i += 1
    return i if i < len(text) else 0


def test_filler_start_is_the_old_search_on_random_texts():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab\n\n") for _ in range(rng.randrange(0, 30)))
        for offset in range(-1, len(text) + 3):
            assert filler_start(text, offset) == old_filler_start(text, offset), (text, offset)


def test_unwrap_and_source_wrap_around():
    assert unwrap("a\nb  c\n \n\n\nd") == "a b c\n\nd"
    src = source("One.\nTwo.", 5, 20)  # from "Two.", then around to the start
    assert src.startswith("Two.\n\nOne. Two.") and len(src) >= 20


def test_trim_snap_and_insert():
    text = "Alpha beta, gamma. Delta"
    assert trim(text, 8) == "Alpha" and trim(text, 100) == text
    tiers = [sentence_ends(text), clause_ends(text)]
    assert snap(text, 16, tiers, 3) == 18        # the sentence end
    assert snap(text, 9, tiers, 3) == 11         # no sentence end near: after the comma
    assert snap(text, 3, tiers, 2) == 5          # neither: the nearest space
    hay, starts = insert("ab cd", [2, 0], ["X", "Y"])
    assert hay == "Y ab X cd" and starts == [5, 0]
