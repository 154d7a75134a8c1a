"""What every benchmark shares: prompts from real text, tables, JSON."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

log = logging.getLogger(__name__)


def parse_list(text: str, kind: type = int) -> list:
    return [kind(x) for x in str(text).split(",") if x.strip()]


def long_text() -> tuple[str, str]:
    """Real prose for prompts: the Austen novels when the Debian package is there, otherwise a
    deterministic shuffled-word text (said so in the output)."""
    try:
        from oasiskv.data.austen import austen_corpus

        return austen_corpus(), "austen"
    except FileNotFoundError as e:
        log.warning("%s; using synthetic text", e)
        rng = random.Random(0)
        words = ("the of and to a in that was her it his she he not be as had with for you "
                 "which but said at have my all on by so this were they would very could "
                 "been been there their what Elizabeth Darcy Emma Anne Marianne letter ball "
                 "house walk fortune sister mother family morning evening").split()
        return " ".join(rng.choice(words) for _ in range(400_000)), "synthetic"


def unique_prompts(tokenizer, count: int, length: int,
                   seed: int = 0) -> tuple[list[list[int]], str]:
    """`count` prompts of exactly `length` tokens from disjoint places in the text (no shared
    prefixes, so no engine can reuse work between them)."""
    text, source = long_text()
    ids = tokenizer.encode(text[: (count * length + length) * 8], add_special_tokens=False)
    if len(ids) < count * length:
        ids = ids * (count * length // max(len(ids), 1) + 1)
    rng = random.Random(seed)
    slots = list(range(len(ids) // length))
    rng.shuffle(slots)
    return [ids[s * length:(s + 1) * length] for s in slots[:count]], source


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """columns: (key, header). Floats get 3 significant digits."""
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)

    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    print(f"wrote {path}")
