"""Sampling generators on the engine's device.

`torch.multinomial` and `torch.rand` draw with a generator of the device their tensor lives on:
a CPU generator cannot sample CUDA logits. So the engine's default generator, each seeded
request's own and one restored from a hand-over are made on the engine's device. A seed draws
different tokens on a CPU and on a GPU (different generators): the same seed on the same kind
of device repeats a run.
"""

from __future__ import annotations

import torch


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on `device` seeded with `seed` (a meta engine, shapes only, samples
    nothing: a CPU one, as torch has no meta generator)."""
    device = torch.device(device)
    return torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed)


def request_generator(device: torch.device, seed: int | None) -> torch.Generator | None:
    """A request's own generator on `device` when it gives a seed (None: the engine's)."""
    return None if seed is None else make_generator(device, seed)


def restore_generator(device: torch.device, state: torch.Tensor,
                      request_id: str) -> torch.Generator:
    """A generator on `device` continuing from `state` (a hand-over's seeded request). A
    state from another kind of device (a CPU prefill worker, a CUDA decode worker) does not
    fit: refused, naming the request."""
    generator = torch.Generator(device=device)
    try:
        generator.set_state(state)
    except RuntimeError as e:
        raise ValueError(f"hand-over of request {request_id!r}: its sampling generator's "
                         f"state ({state.numel()} bytes) does not fit a {device.type} "
                         f"generator; run both workers on the same kind of device "
                         f"({str(e).splitlines()[0]})") from None
    return generator
