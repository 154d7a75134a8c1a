"""torch.compile for the few functions that eager PyTorch runs as several passes over large
temporaries, with the eager function as the fallback.

Compiled, such a function is one fused pass over its inputs (on CPU a C++ kernel that inductor
builds with the machine's compiler, on GPU a Triton kernel). Where compiling fails (no C++
compiler, an unsupported device) it warns once and runs eagerly: same results up to summation
order, slower. TORCHDYNAMO_DISABLE=1 skips compiling altogether.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch


class compiled:  # noqa: N801 (used as a decorator)
    """fn compiled for any shapes (dynamic) at its first call; eager if compiling fails:
    `fallback` where given (the same function written for eager PyTorch: a form that fuses
    well can build a huge temporary when it runs unfused), else fn itself."""

    def __init__(self, fn: Callable[..., torch.Tensor],
                 fallback: Callable[..., torch.Tensor] | None = None) -> None:
        self.eager = fallback or fn  # what runs uncompiled
        self._source = fn  # what is compiled
        self._run: Callable[..., torch.Tensor] | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if self._run is None:
            self._run = torch.compile(self._source, dynamic=True)
        try:
            return self._run(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            self._run = self.eager
            reason = str(e).strip().splitlines()[0]
            warnings.warn(f"torch.compile of {self.eager.__qualname__} failed ({reason}); "
                          "running it eagerly, which is slower", RuntimeWarning, stacklevel=2)
            return self.eager(*args)
