"""Triton kernels for the CUDA path (issue 46): decode attention over the pool and its slabs
(`decode.py`, planned per step by `layers/triton_attention.py`) and the block-head gather into
the slab (`gather.py`, called through `layers/block_gather.py`). Each has a PyTorch reference
that the tests compare it with under Triton's interpreter on the CPU (`TRITON_INTERPRET=1`).

Triton is imported only here, lazily: the package imports and runs without it, and on a CPU
device nothing calls these kernels. OASISKV_CUDA_ATTENTION=torch keeps CUDA on the PyTorch paths.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

ENV = "OASISKV_CUDA_ATTENTION"
CHOICES = ("triton", "torch")

_missing: set[str] = set()  # modules that failed to import: warned once, not retried


def wanted() -> bool:
    """OASISKV_CUDA_ATTENTION: triton (the default) or torch."""
    choice = os.environ.get(ENV, "triton").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice == "triton"


def load(name: str) -> ModuleType | None:
    """The kernel module `name` ("decode", "gather") where OASISKV_CUDA_ATTENTION allows it and
    triton imports; else None (a missing triton warned once per module)."""
    if not wanted() or name in _missing:
        return None
    try:  # imported once (sys.modules); a failure is warned once
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:  # no triton: the PyTorch paths serve
        _missing.add(name)
        warnings.warn(f"the Triton kernels are not available ({e}); CUDA runs the PyTorch "
                      "paths (pip install triton)", RuntimeWarning, stacklevel=2)
        return None
