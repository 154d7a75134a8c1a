"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators."""

import torch

from oasiskv.sampling_params import SamplingParams


def sample_one(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    # logits [V]
    if params.greedy:
        return int(torch.argmax(logits))
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
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


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
