"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators; and
verification of a draft token (speculative decoding) that leaves the distribution unchanged."""

import torch

from oasiskv.sampling_params import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: [V] logits -> [V] probabilities
    after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample_one(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    # logits [V]
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def verify_draft(logits: torch.Tensor, draft: int, params: SamplingParams,
                 generator: torch.Generator | None) -> tuple[int, bool]:
    """Speculative sampling with a deterministic drafter (q = one-hot at the draft): keep the
    draft with probability p(draft), else sample from p with the draft removed, renormalised.
    The result is distributed exactly as p. Greedy: keep the draft iff it is the argmax."""
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, token == draft
    p = probabilities(logits, params)
    if torch.rand((), generator=generator, device=p.device) < p[draft]:
        return draft, True
    rest = p.clone()
    rest[draft] = 0
    return int(torch.multinomial(rest, 1, generator=generator)), False


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int | Exception]:
    """One token per row, or the exception that row raised: a failure belongs to its own
    request, and the other rows' seeded generators advance exactly as in a clean run."""
    # logits [S, V]
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    out: list[int | Exception] = []
    for row, p, g in zip(logits, params, generators, strict=True):
        try:
            out.append(sample_one(row, p, g))
        except Exception as e:  # noqa: BLE001 - reported per request by the engine
            out.append(e)
    return out
