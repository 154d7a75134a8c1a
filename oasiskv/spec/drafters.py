"""Drafters: guesses of the next token, made before the step that computes it.

At the end of step t the engine knows x_{t+1} (just sampled) and the logits of step t's draft
row (which saw the draft x^_{t+1}). A drafter turns those into the draft(s) x^_{t+2} that ride
along with x_{t+1} in step t+1; the draft's per-layer queries then predict step t+2's blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Drafter(ABC):
    name: str

    @abstractmethod
    def propose(self, tokens: list[int], draft_logits: torch.Tensor | None,
                prev_draft: int | None, num: int = 1) -> list[int]:
        """`num` distinct guesses of the token after tokens[-1], best first.

        tokens: the request's tokens so far (prompt + output, newest last);
        draft_logits: [V] logits of the previous step's first draft row, or None;
        prev_draft: that draft token (compare with tokens[-1] to know if it was right).
        """


def _fill(guesses: list[int], tokens: list[int], num: int) -> list[int]:
    """Pads with the newest tokens (a repetition guess) when nothing better is known."""
    out = list(dict.fromkeys(guesses))
    for t in reversed(tokens):
        if len(out) >= num:
            break
        if t not in out:
            out.append(t)
    return out[:num]


class SelfDrafter(Drafter):
    """SpeCache-style chain: the draft row's own argmax becomes the next draft."""

    name = "self"

    def propose(self, tokens, draft_logits, prev_draft, num=1):
        if draft_logits is None:  # first decode step: no draft row yet
            return NgramDrafter().propose(tokens, None, None, num)
        return torch.topk(draft_logits, num).indices.tolist()


class NgramDrafter(Drafter):
    """Prompt lookup: the token that followed the latest earlier occurrence of the last 3, 2
    or 1 tokens; falls back to the self draft."""

    name = "ngram"

    def __init__(self, sizes: tuple[int, ...] = (3, 2, 1)) -> None:
        self.sizes = sizes

    def propose(self, tokens, draft_logits, prev_draft, num=1):
        guesses: list[int] = []
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest match first
                if tokens[start:start + n] == suffix:
                    guesses.append(tokens[start + n])
                    if len(set(guesses)) >= num:
                        return _fill(guesses, tokens, num)
                    break
        if draft_logits is not None:
            guesses += torch.topk(draft_logits, num).indices.tolist()
        return _fill(guesses, tokens, num)


class ResyncDrafter(Drafter):
    """The self chain while its previous draft was right; prompt lookup after a miss (a wrong
    draft makes the self chain's next guess condition on a token that never happened)."""

    name = "resync"

    def propose(self, tokens, draft_logits, prev_draft, num=1):
        if prev_draft is None or prev_draft == tokens[-1]:
            return SelfDrafter().propose(tokens, draft_logits, prev_draft, num)
        return NgramDrafter().propose(tokens, None, prev_draft, num)


DRAFTERS: dict[str, type[Drafter]] = {d.name: d for d in (SelfDrafter, NgramDrafter,
                                                           ResyncDrafter)}


def make_drafter(name: str) -> Drafter:
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; known: {sorted(DRAFTERS)}")
    return DRAFTERS[name]()
