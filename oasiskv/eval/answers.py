"""Whether an output gives an answer: whole numbers with or without thousands separators,
found anywhere in the text (``rule="contains"``) or as the whole output (``rule="exact"``)."""

from __future__ import annotations

import re

# A number written with thousands separators: 48,213 / 48 213 / 1,234,567 / 1.234.567.
_GROUPED = re.compile(r"(?<![\d,.])\d{1,3}(?:(?:,|\.|[ \u00a0\u2009\u202f'_])\d{3})+(?![\d])")
_DIGITS = re.compile(r"\d+")


def _ungroup(text: str) -> str:
    return _GROUPED.sub(lambda m: re.sub(r"\D", "", m.group(0)), text)


def numbers_in(text: str) -> list[str]:
    """The whole numbers in `text`, thousands separators removed ("48,213" -> "48213")."""
    return _DIGITS.findall(_ungroup(text))


def _normalize(text: str) -> str:
    return " ".join(_ungroup(text).split()).strip().rstrip(".").strip().casefold()


def match_answer(answer: str, output: str, rule: str = "contains") -> bool:
    """Whether `output` gives `answer`.

    ``rule="exact"``: the whole output, separators removed, spaces collapsed, case folded and a
    final period dropped, equals the answer. ``rule="contains"``: a numeric answer appears in
    the output as a whole number (so "48213" is found in "The pass key is 48,213." but not in
    "482130"); any other answer appears as a case-insensitive substring.
    """
    answer = answer.strip()
    if rule == "exact":
        return _normalize(output) == _normalize(answer)
    if rule != "contains":
        raise ValueError(f"unknown rule {rule!r}; choose 'contains' or 'exact'")
    if answer.isdigit():
        return answer in numbers_in(output)
    return _normalize(answer) in _normalize(output)
