"""Passages start at the paragraph at or after an offset and hold exactly the asked tokens."""

import pytest
from conftest import build_tokenizer

from oasiskv.data.passages import paragraph_prompt, paragraph_start, paragraph_starts


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


TEXT = "Title\nline two\n\nFirst para, line one\nline two.\n\n\nSecond para.\n\nThird one.\n"


@pytest.mark.parametrize("offset, want", [
    (0, 0),
    (TEXT.index("First"), TEXT.index("First")),
    (TEXT.index("First") - 1, TEXT.index("First")),  # on the blank line
    (TEXT.index("First") + 1, TEXT.index("Second")),  # inside a paragraph: the next one
    (TEXT.index("Second") - 2, TEXT.index("Second")),  # after two blank lines
    (TEXT.index("Third"), TEXT.index("Third")),
])
def test_paragraph_start_is_at_or_after_the_offset(offset, want):
    start = paragraph_start(TEXT, offset)
    assert start == want and start >= offset
    assert start == 0 or (TEXT[start - 2:start] == "\n\n" and TEXT[start] != "\n")


def test_every_paragraph_start():
    assert paragraph_starts(TEXT) == [TEXT.index(w) for w in ("First", "Second", "Third")]
    assert paragraph_starts("one\n\n\n\n") == [] and paragraph_starts("") == []
    # each is the paragraph_start of every offset since the one before
    starts = [0, *paragraph_starts(TEXT)]
    for a, b in zip(starts, starts[1:], strict=False):
        assert {paragraph_start(TEXT, o) for o in range(a + 1, b + 1)} == {b}


def test_no_paragraph_after_the_offset_is_an_error():
    with pytest.raises(ValueError, match="no paragraph"):
        paragraph_start(TEXT, TEXT.index("Third") + 1)


def test_paragraph_prompt_has_exactly_the_length_and_starts_the_paragraph(tokenizer):
    text = "\n\n".join(f"Paragraph {i}: a truth universally acknowledged." for i in range(300))
    offset = 1000
    start, ids = paragraph_prompt(tokenizer, text, offset, 150)
    assert start >= offset and text[start - 2:start] == "\n\n"
    assert len(ids) == 150
    assert tokenizer.decode(ids).startswith(text[start:start + 20])
    assert ids == tokenizer.encode(text[start:], add_special_tokens=False)[:150]
