"""nn.Linear with faster CPU paths for inference.

Measured on the project's CPU (2 threads, 30 layers of SmolLM2's shapes): oneDNN repacks a
plain weight into its blocked layout on every `F.linear` call; a weight packed once
(`pack`) runs the linear layers 1.3-1.7x faster in bfloat16 at any row count, and 1.2-2x in
float32 from 4 rows up (at 3 rows it ties with `W @ x.T`). For one or two float32 rows MKL's
product written as `W @ x.T` with two columns is faster still (one column takes the slow gemv
path). Results differ from F.linear only by summation order.
"""

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.layers import gemv

SMALL_BATCH = 16  # float32, unpacked: below this many rows `W @ x.T` beats F.linear
FP32_GEMV_ROWS = 2  # float32: up to this many rows `W @ x.T` beats the packed weight


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packs float32 on any x86 CPU, bfloat16 only where it has a bf16 path
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: not on an AVX2-only CPU)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout (inference)
    gemv_packed: gemv.Packed | None = None  # the bf16 kernel's copy (few rows; layers/gemv.py)

    def pack(self) -> None:
        """Keeps a copy of the weight that oneDNN reads without repacking (inference on CPU:
        the packed copy has no autograd and is not updated when the weight changes)."""
        if can_pack(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                  SMALL_BATCH)
            self.gemv_packed = gemv.pack(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv.serves(self.gemv_packed, x):  # bf16, a few rows, inference: the kernel
            return gemv.linear(self.gemv_packed, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else SMALL_BATCH
        fp32 = x.dtype == torch.float32 and x.device.type == "cpu"
        if self.packed is not None and not torch.is_grad_enabled() and not (
                fp32 and rows <= FP32_GEMV_ROWS):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if not fp32 or rows >= SMALL_BATCH:
            return F.linear(x, self.weight, self.bias)
        cols = x if rows > 1 else torch.cat([x, x])
        out = torch.matmul(self.weight, cols.T)[:, :rows].T  # [rows, out]
        return out if self.bias is None else out + self.bias


def pack_linears(model: nn.Module, like: nn.Module | None = None) -> None:
    """Packs every Linear of an inference model; given `like`, a model of the same
    architecture that shares its weights (`LLMEngine(share_weights=)`), shares its packed
    copies too."""
    if like is None:
        for module in model.modules():
            if isinstance(module, Linear):
                module.pack()
        return
    for module, other in zip(model.modules(), like.modules(), strict=True):
        if isinstance(module, Linear):
            module.packed, module.gemv_packed = other.packed, other.gemv_packed
