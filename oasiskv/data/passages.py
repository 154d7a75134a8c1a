"""Paragraphs of running text, where a paragraph starts after a blank line ("\\n\\n"): the one
place that says so, for the prompts of `eval recall`, the perplexity passages of `eval ppl`
and the filler of the fidelity tasks (`eval/filler.py`)."""

from __future__ import annotations

import re

_PARAGRAPH = re.compile(r"(?<=\n\n)[^\n]")


def paragraph_starts(text: str) -> list[int]:
    """Index of every paragraph's first character after the first paragraph: a character
    that is not a newline and follows a blank line."""
    return [m.start() for m in _PARAGRAPH.finditer(text)]


def paragraph_start(text: str, offset: int) -> int:
    """Index of the first paragraph start at or after `offset`: a character that is not a
    newline and follows a blank line ("\\n\\n"), or the text's first character."""
    if offset <= 0 and text[:1] not in ("", "\n"):
        return 0
    m = _PARAGRAPH.search(text, max(offset, 0))
    if m is None:
        raise ValueError(f"no paragraph starts at or after character {offset}")
    return m.start()


def paragraph_prompt(tokenizer, text: str, offset: int, length: int) -> tuple[int, list[int]]:
    """(start, ids): exactly `length` tokens of `text` from the paragraph start at or after
    `offset`, encoded as plain text (no special tokens)."""
    start = paragraph_start(text, offset)
    span = length * 6
    while True:
        ids = tokenizer.encode(text[start:start + span], add_special_tokens=False)
        if len(ids) > length + 8:  # the cut at the slice's end cannot reach our tokens
            return start, ids[:length]
        if start + span >= len(text):
            if len(ids) >= length:
                return start, ids[:length]
            raise ValueError(f"the text after character {start} holds only {len(ids)} tokens, "
                             f"{length} wanted")
        span *= 2
