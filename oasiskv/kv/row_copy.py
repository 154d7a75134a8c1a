"""Whole rows from one pool into another by index, `dst[dst_rows] = src[src_rows]`: the
sparse step's local stage (admitted block-heads, host pool -> device slots). On the CPU by a
small C++ loop (`layers/csrc/copy_rows.cpp`, one memcpy a row: 3.5x faster than the
index_select + index_copy_ it replaces, which writes a temporary and reads it again); built
and loaded as the other kernels are (`layers/decode_kernel.load`), and where it cannot be,
or off the CPU, or for a non-contiguous pool, PyTorch's indexing (warned once)."""

from __future__ import annotations

from types import ModuleType

import torch

from oasiskv.layers import decode_kernel

SOURCE = decode_kernel.SOURCE.with_name("copy_rows.cpp")


def extension() -> ModuleType | None:
    """The built kernel (None where it could not be built or loaded: warned once)."""
    return decode_kernel.load(SOURCE, "the row-copy kernel", "copying rows by indexing")


def copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor,
              src_rows: torch.Tensor) -> None:
    """dst [rows, w], src [rows', w] of one dtype; dst_rows, src_rows [n] int64."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous()
            and src.is_contiguous()):
        ext = extension()
        if ext is not None:
            ext.copy_rows(dst, dst_rows.contiguous(), src, src_rows.contiguous())
            return
    dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))
