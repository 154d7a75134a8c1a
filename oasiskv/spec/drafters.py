"""Drafters: guesses of the next token, made before the step that computes it.

At the end of step t the engine knows x_{t+1} (just sampled) and the logits of step t's draft
row (which saw the draft x^_{t+1}). A drafter turns those into the draft(s) x^_{t+2} that ride
along with x_{t+1} in step t+1; the draft's per-layer queries then predict step t+2's blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oasiskv.config import head_dir
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.sampling_params import SamplingParams
from oasiskv.spec.eagle import load_head

if TYPE_CHECKING:
    from oasiskv.sequence import Sequence


class Drafter(ABC):
    name: str
    # Target layers whose outputs the drafter reads; the engine then calls observe() with the
    # features of every position it computes.
    feature_layers: tuple[int, ...] = ()

    @abstractmethod
    def propose_weighted(self, tokens: list[int], draft_logits: torch.Tensor | None,
                         prev_draft: int | None, num: int = 1, request_id: str = "",
                         ) -> tuple[list[int], list[float] | None]:
        """`num` distinct guesses of the token after tokens[-1], best first, and the drafter's
        probability of each (None where it has none, as prompt lookup).

        tokens: the request's tokens so far (prompt + output, newest last);
        draft_logits: [V] logits of the previous step's draft row that was right (the first
        when none was), or None;
        prev_draft: that draft token (compare with tokens[-1] to know if it was right);
        request_id: for drafters that keep state per request.
        """

    def propose(self, tokens: list[int], draft_logits: torch.Tensor | None,
                prev_draft: int | None, num: int = 1, request_id: str = "") -> list[int]:
        """The guesses of `propose_weighted` alone."""
        return self.propose_weighted(tokens, draft_logits, prev_draft, num, request_id)[0]

    def observe(self, request_id: str, start: int,  # noqa: B027 - optional
                features: torch.Tensor) -> None:
        """Features [n, F] of `feature_layers` at positions start..start+n-1 of a request."""

    def release(self, request_id: str) -> None:  # noqa: B027 - optional: stateless by default
        """The request ended: drop whatever state the drafter keeps for it."""


def chained_draft(drafts: list[int], token: object) -> int:
    """The draft row the draft chain continues from: the one that guessed `token`, when one
    did (with several drafts, a miss of the first need not break the chain), else the first."""
    return drafts.index(token) if token in drafts else 0


def top_guesses(logits: torch.Tensor, num: int) -> tuple[list[int], list[float]]:
    """The `num` likeliest tokens of [V] logits and their probabilities."""
    top = torch.topk(torch.softmax(logits.float(), -1), num)
    return top.indices.tolist(), top.values.tolist()


def sampling_weights(probs: list[float] | None, num: int,
                     temperature: float) -> list[float] | None:
    """How likely each of `num` drafts (best first) is to be the token the request takes next,
    up to a factor: greedy decoding takes the drafter's best guess (weight 1 for the first,
    0 for the rest); sampling at T takes draft i about as often as p_i^(1/T), the drafter's
    probabilities standing for the target's at T=1. None: no probabilities (equal weights).
    (`eval recall --num-drafts`: at T=0 the first draft alone recalls the next step's blocks
    best, at T=0.7 these weights beat both the first alone and the plain mean.)"""
    if temperature == 0:
        return [1.0] + [0.0] * (num - 1)
    if probs is None:
        return None
    return [(p / probs[0]) ** (1.0 / temperature) for p in probs]  # the first: 1, no underflow


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

    def propose_weighted(self, tokens, draft_logits, prev_draft, num=1, request_id=""):
        if draft_logits is None:  # first decode step: no draft row yet
            return NgramDrafter().propose_weighted(tokens, None, None, num)
        return top_guesses(draft_logits, num)


class NgramDrafter(Drafter):
    """Prompt lookup: the token that followed the latest earlier occurrence of the last 3, 2
    or 1 tokens; falls back to the self draft."""

    name = "ngram"

    def __init__(self, sizes: tuple[int, ...] = (3, 2, 1)) -> None:
        self.sizes = sizes
        # request -> its tokens as an array, extended by the new tokens at each call: turning
        # a 7K-token list into an array anew took 0.2 ms per request and step
        self._ids: dict[str, np.ndarray] = {}

    def _array(self, tokens: list[int], request_id: str) -> np.ndarray:
        ids = self._ids.get(request_id) if request_id else None
        if ids is None or len(ids) > len(tokens) or ids[-1] != tokens[len(ids) - 1]:
            ids = np.asarray(tokens)
        elif len(ids) < len(tokens):
            ids = np.concatenate([ids, tokens[len(ids):]])
        if request_id:
            self._ids[request_id] = ids
        return ids

    def propose_weighted(self, tokens, draft_logits, prev_draft, num=1, request_id=""):
        guesses: list[int] = []
        ids = self._array(tokens, request_id)
        # ends of earlier windows (each with a token after it) that match the last token; a
        # longer window also matches the tokens before (vectorised: a Python scan of a long
        # context costs ms)
        ends = np.flatnonzero(ids[:-1] == ids[-1])
        for n in self.sizes:
            if len(ids) <= n:
                continue
            matches = ends[ends >= n - 1]
            for back in range(1, n):
                matches = matches[ids[matches - back] == ids[-1 - back]]
            if len(matches):
                guesses.append(int(ids[matches[-1] + 1]))  # the latest match
                if len(set(guesses)) >= num:
                    return _fill(guesses, tokens, num), None
        if draft_logits is not None:
            guesses += torch.topk(draft_logits, num).indices.tolist()
        return _fill(guesses, tokens, num), None

    def release(self, request_id: str) -> None:
        self._ids.pop(request_id, None)


class ResyncDrafter(Drafter):
    """The self chain while its previous draft was right; prompt lookup after a miss (a wrong
    draft makes the self chain's next guess condition on a token that never happened)."""

    name = "resync"

    def __init__(self) -> None:
        self.ngram = NgramDrafter()

    def propose_weighted(self, tokens, draft_logits, prev_draft, num=1, request_id=""):
        if prev_draft is None or prev_draft == tokens[-1]:
            return SelfDrafter().propose_weighted(tokens, draft_logits, prev_draft, num)
        return self.ngram.propose_weighted(tokens, None, prev_draft, num, request_id)

    def release(self, request_id: str) -> None:
        self.ngram.release(request_id)


class ModelDrafter(Drafter):
    """A separate small model sharing the tokenizer, run between steps: it keeps its own dense
    KV per request, computes the tokens it has not seen yet and proposes its top tokens.

    `make_engine(model=..., **engine_kwargs)` builds the engine that runs it (the target's
    engine passes its own `LLMEngine.from_kwargs`: drafters sit below the engine and do not
    import it)."""

    name = "model"

    def __init__(self, model: str, vocab_size: int, make_engine: Callable[..., Any],
                 **engine_kwargs) -> None:
        self.engine = make_engine(model=model, **engine_kwargs)
        if self.engine.model_config.vocab_size != vocab_size:
            raise ValueError(f"draft model {model!r} has a vocabulary of "
                             f"{self.engine.model_config.vocab_size} tokens, the target "
                             f"{vocab_size}: a draft model must share the tokenizer")
        self.seqs: dict[str, Sequence] = {}

    def propose_weighted(self, tokens, draft_logits, prev_draft, num=1, request_id=""):
        seq = self.seqs.get(request_id)
        if seq is None:
            seq = self.engine.make_sequence(list(tokens), SamplingParams(max_tokens=1))
            self.seqs[request_id] = seq
        seq.token_ids[:] = tokens  # its KV covers only true tokens, so the prefix matches
        logits = self.engine.forward(seq).logits  # the tokens it has not seen yet
        seq.num_computed_tokens = len(tokens)
        return top_guesses(logits[0], num)

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.engine.free(seq)


@dataclass
class _HeadState:
    features: torch.Tensor  # [n, F] the target's, at positions feature_start..
    feature_start: int
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the head's own
    next_row: int = 0  # head rows < next_row are computed
    logits: torch.Tensor | None = None  # [Vd] of row next_row - 1: guesses x_{next_row}

    @property
    def feature_end(self) -> int:
        return self.feature_start + len(self.features)


class EagleDrafter(Drafter):
    """A trained EAGLE-style head (`spec/eagle.py`): row p reads x_p and the target's features
    at p-1 and guesses x_{p+1}. Falls back to prompt lookup while it has no features."""

    name = "eagle"

    def __init__(self, path: str, target: LlamaForCausalLM) -> None:
        self.head = load_head(path, target)
        self.window = self.head.config.window
        self.feature_layers = tuple(self.head.config.aux_layers)
        self.states: dict[str, _HeadState] = {}
        self.ngram = NgramDrafter()

    def observe(self, request_id, start, features):
        st = self.states.get(request_id)
        if st is not None and start == st.feature_end:  # continues what the head has seen
            start, features = st.feature_start, torch.cat([st.features, features])
        else:  # a new request, or one recomputed after preemption
            st = self.states[request_id] = _HeadState(features, start)
        st.features = features[-(self.window + 1):]  # later rows need only these
        st.feature_start = start + len(features) - len(st.features)
        st.next_row = max(st.next_row, st.feature_start + 1)

    @torch.inference_mode()
    def propose_weighted(self, tokens, draft_logits, prev_draft, num=1, request_id=""):
        st = self.states.get(request_id)
        if st is not None:
            first = max(st.next_row, st.feature_start + 1, len(tokens) - self.window)
            last = min(st.feature_end, len(tokens) - 1)  # needs f_{p-1} and x_p
            if first <= last:
                self._run(st, tokens, first, last)
        if st is None or st.logits is None or st.next_row != len(tokens):
            return self.ngram.propose_weighted(tokens, None, prev_draft, num, request_id)
        guesses, probs = top_guesses(st.logits, num)  # over the draft vocabulary
        return self.head.d2t[guesses].tolist(), probs

    def _run(self, st: _HeadState, tokens: list[int], first: int, last: int) -> None:
        device = self.head.d2t.device  # the target's
        positions = torch.arange(first, last + 1, device=device)
        ids = torch.tensor(tokens[first:last + 1], device=device)[None]  # [1, S]
        feats = st.features[first - 1 - st.feature_start:last - st.feature_start][None]
        past = st.kv
        if past is not None and past[2][-1] != first - 1:  # rows skipped: start afresh
            past = None
        hidden, (k, v, kpos) = self.head(ids, feats, positions, past)
        keep = kpos > last + 1 - self.window  # what later rows can still see
        st.kv = (k[:, keep], v[:, keep], kpos[keep])
        st.next_row = last + 1
        st.logits = self.head.logits(hidden[0, -1])

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.ngram.release(request_id)


class ResyncEagleDrafter(EagleDrafter):
    """The self chain while its previous draft was right: the draft row then saw the true
    token, so its logits are the next step's (up to the working set it attended), which one
    head layer only approximates. The head after a miss and at the first step, where the
    chain would condition on a token that never happened. The head catches up on the rows it
    skipped when it is next asked."""

    name = "resync-eagle"

    def propose_weighted(self, tokens, draft_logits, prev_draft, num=1, request_id=""):
        if draft_logits is not None and prev_draft == tokens[-1]:
            return SelfDrafter().propose_weighted(tokens, draft_logits, prev_draft, num)
        return super().propose_weighted(tokens, draft_logits, prev_draft, num, request_id)


DRAFTERS: dict[str, type[Drafter]] = {d.name: d for d in (SelfDrafter, NgramDrafter,
                                                           ResyncDrafter, ModelDrafter)}


def make_drafter(name: str, draft_model: str | None = None, vocab_size: int = 0,
                 target: LlamaForCausalLM | None = None,
                 make_engine: Callable[..., Any] | None = None, **engine_kwargs) -> Drafter:
    """`name` is a drafter of DRAFTERS, `eagle:DIR` or `resync-eagle:DIR` (a head trained
    for the target). Drafter 'model' runs `draft_model` in an engine that `make_engine`
    builds (`ModelDrafter`)."""
    path = head_dir(name)
    if path is not None:
        if target is None:
            raise ValueError("an eagle drafter reads the target model's features: pass target")
        return (ResyncEagleDrafter if name.startswith("resync-") else EagleDrafter)(path, target)
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; known: {sorted(DRAFTERS)}, eagle:DIR or "
                         "resync-eagle:DIR")
    if name == "model":
        if not draft_model:
            raise ValueError("drafter 'model' needs draft_model (a model alias, HF directory "
                             "or .gguf file sharing the target's tokenizer)")
        if make_engine is None:
            raise ValueError("drafter 'model' runs a second engine: pass make_engine (the "
                             "target engine's LLMEngine.from_kwargs)")
        return ModelDrafter(draft_model, vocab_size, make_engine, **engine_kwargs)
    return DRAFTERS[name]()
