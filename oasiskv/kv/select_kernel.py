"""The selection's top-k and capped-LRU update on the CPU by a small C++ kernel
(`layers/csrc/select_blocks.cpp`): what `torch.topk` and `kv/select.select_capped_lru_batch`
compute, one task a (layer, request, KV head) instead of ~40 tensor ops over the batch (a
head's selection is a few hundred numbers, so the ops were mostly overhead: 2 ms of top-k and 3
of selection in a 53 ms step at 7K x 6 on a 2-core EPYC). Built and loaded as the other kernels
are (`layers/decode_kernel.load`); off the CPU, or where it cannot be built, the PyTorch ops
(the reference the tests compare it with). One difference: among equal scores (pinned blocks'
+inf) the kernel ranks the lower block first, where topk's order is unspecified."""

from __future__ import annotations

from types import ModuleType

import torch

from oasiskv.layers import decode_kernel

SOURCE = decode_kernel.SOURCE.with_name("select_blocks.cpp")
ENV = "OASISKV_SELECT"
CHOICES = ("kernel", "torch")


def extension() -> ModuleType | None:
    """The built kernel (None: OASISKV_SELECT=torch, or it could not be built or loaded)."""
    if decode_kernel.choice(ENV, CHOICES, "kernel") != "kernel":
        return None
    return decode_kernel.load(SOURCE, "the selection kernel", "selecting with PyTorch ops")


def serves(t: torch.Tensor, *in_place: torch.Tensor) -> ModuleType | None:
    """The kernel where it selects for tensors on t's device (the CPU) and the tensors it
    writes in place (working sets, masks) are contiguous, else None."""
    if t.device.type != "cpu" or not all(x.is_contiguous() for x in in_place):
        return None
    return extension()
