"""The filler of the fidelity tasks: real prose unwrapped into paragraphs, read from a
paragraph start, tokenized with character offsets, and the sentence and clause boundaries
where needles go in."""

from __future__ import annotations

import bisect
import functools
import re

from oasiskv.data.passages import paragraph_start, paragraph_starts


@functools.lru_cache(maxsize=1)
def default_text() -> str:
    from oasiskv.data.austen import austen_corpus

    return austen_corpus()


def unwrap(text: str) -> str:
    """Hard-wrapped lines into paragraphs: single newlines become spaces, blank-line runs one
    blank line, runs of spaces one space."""
    text = text.replace("\r\n", "\n")
    text = re.sub(r"[ \t]*\n[ \t]*", "\n", text)
    text = re.sub(r"(?<!\n)\n(?!\n)", " ", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return re.sub(r"[ \t]{2,}", " ", text)


def filler_start(text: str, offset: int) -> int:
    """Where filler drawn at `offset` starts: the first paragraph whose blank line begins at or
    after `offset` (so never the paragraph `offset` is in, even at its first character), else
    the text's start (offset 0, or none left: the filler wraps around)."""
    if offset <= 0:
        return 0
    try:  # the paragraph's first character follows its blank line: two characters on
        return paragraph_start(text, offset + 2)
    except ValueError:
        return 0


def source(text: str, start: int, min_chars: int) -> str:
    """Unwrapped text from `start`, wrapping around to the beginning until `min_chars` long."""
    parts, total, pos = [], 0, start
    while total < min_chars:
        chunk = text[pos:pos + min_chars - total + 4096]
        if not chunk:
            if pos == 0:
                raise ValueError("filler text is empty")
            pos = 0
            continue
        parts.append(chunk)
        total += len(chunk)
        pos += len(chunk)
        if pos >= len(text):
            parts.append("\n\n")
            pos = 0
    src = unwrap("".join(parts)).lstrip()
    if not src.strip():
        raise ValueError("filler text is blank")
    return src


class Tokenized:
    """Offsets of `text`'s tokens (no special tokens): token i spans chars [starts[i], ends[i])."""

    def __init__(self, tokenizer, text: str) -> None:
        self.text = text
        if getattr(tokenizer, "is_fast", False):
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            self.starts = [s for s, _ in enc["offset_mapping"]]
            self.ends = [e for _, e in enc["offset_mapping"]]
        else:  # slow tokenizer: decode-length offsets (approximate at multi-byte characters)
            ids = tokenizer.encode(text, add_special_tokens=False)
            self.starts, self.ends, pos = [], [], 0
            for i in range(len(ids)):
                end = min(len(tokenizer.decode(ids[:i + 1])), len(text))
                self.starts.append(pos)
                self.ends.append(end)
                pos = end

    def __len__(self) -> int:
        return len(self.starts)


_ABBREVIATIONS = frozenset({"Mr", "Mrs", "Ms", "Dr", "St", "Messrs", "Mme", "Mlle", "Col", "Capt",
                            "Gen", "Sir", "Rev", "Lt", "No", "vol", "ch", "viz", "i.e", "e.g",
                            "etc", "Esq"})


def sentence_ends(text: str) -> list[int]:
    """Char positions right after a sentence or paragraph end (before its whitespace)."""
    ends = set()
    for m in re.finditer(r"(\S*?)([.!?])[\"'\u201d\u2019)]?(?=\s)", text):
        word = m.group(1).lstrip("\"'(\u201c\u2018")
        if m.group(2) == "." and (word in _ABBREVIATIONS or (len(word) == 1 and word.isupper())):
            continue  # "Mrs. Allen", "J. Thorpe": not a sentence end
        ends.add(m.end())
    for start in paragraph_starts(text):  # a paragraph break: before the next paragraph
        ends.discard(start - 2)  # (unwrapped text: one blank line, "\n\n", between them)
        ends.add(start)
    ends.update((0, len(text)))
    return sorted(ends)


def clause_ends(text: str) -> list[int]:
    """Char positions right after a comma, semicolon, colon or dash (before whitespace)."""
    ends = {m.end() for m in re.finditer(r"(?:[,;:]|--)(?=\s)", text)}
    ends.update((0, len(text)))
    return sorted(ends)


def _nearest(boundaries: list[int], pos: int, window: int) -> int | None:
    i = bisect.bisect_left(boundaries, pos)
    near = [b for b in boundaries[max(i - 1, 0):i + 1] if abs(b - pos) <= window]
    return min(near, key=lambda b: (abs(b - pos), b)) if near else None


def snap(text: str, pos: int, tiers: list[list[int]], window: int) -> int:
    """The boundary nearest `pos` within `window` chars from the first tier that has one
    (sentence ends, then clause ends), else the nearest whitespace (a word boundary)."""
    if pos <= 0:
        return 0
    if pos >= len(text):
        return len(text)
    for boundaries in tiers:
        found = _nearest(boundaries, pos, window)
        if found is not None:
            return found
    for d in range(0, max(window, 1) + 1):
        for p in (pos - d, pos + d):
            if 0 < p < len(text) and text[p].isspace():
                return p
    return pos


def trim(text: str, end: int) -> str:
    """`text[:end]` cut back to a word boundary (never to nothing) and right-stripped."""
    if end >= len(text):
        return text.rstrip()
    cut = text[:end]
    if not text[end].isspace():
        ws = max(cut.rfind(" "), cut.rfind("\n"))
        if ws > 0:
            cut = cut[:ws]
    return cut.rstrip()




def insert(filler: str, positions: list[int], texts: list[str]) -> tuple[str, list[int]]:
    """Inserts texts[i] at filler char positions[i] (a space either side where there is none);
    returns (haystack, start of each text in it)."""
    order = sorted(range(len(texts)), key=lambda i: (positions[i], i))
    buf, starts, prev = "", [0] * len(texts), 0
    for i in order:
        pos = positions[i]
        buf += filler[prev:pos]
        if buf and not buf[-1].isspace():
            buf += " "
        starts[i] = len(buf)
        buf += texts[i]
        if pos < len(filler) and not filler[pos].isspace():
            buf += " "
        prev = pos
    return buf + filler[prev:], starts
