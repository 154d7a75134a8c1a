"""Moving the sparse KV's data between the host and the device without stopping the host.

On a CUDA device a blocking copy (`tensor.to(device)` of pageable memory, a read-back such as
`int(tensor)`) waits for the stream's earlier work: on the prefetch path that would serialise
the background streams with the foreground. So:
- `upload`: small host metadata (built from Python lists) goes to the device through pinned
  memory, non-blocking (the caching host allocator keeps the pinned buffer until the copy ran);
- `device_view`: the pinned host pool as a tensor that device kernels index directly (unified
  addressing: a gather reads the selected block-heads over PCIe with device-side indices, no
  index ever comes back to the host);
- `download`: device -> pinned host copies, non-blocking.
On the CPU each is the plain operation (the same tensor, or a copy)."""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: itself on the CPU; on CUDA a non-blocking copy from pinned
    memory."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class _CudaArray:
    """`__cuda_array_interface__` of a pinned host tensor: with unified addressing its host
    address is valid on the device, so torch.as_tensor wraps it as a CUDA tensor (no copy)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._keep = t
        typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.int16: "<i2",
                   torch.int8: "|i1", torch.uint8: "|u1", torch.int64: "<i8"}[t.dtype]
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": typestr, "data": (t.data_ptr(), False),
            "strides": tuple(s * t.element_size() for s in t.stride()), "version": 3}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host pool `host` as a tensor on `device` that aliases it (no copy): itself on the
    CPU; on CUDA a view of its pinned memory through unified addressing (bf16 travels as
    int16 and is viewed back). Raises ValueError for a pageable pool on CUDA."""
    if device.type != "cuda":
        return host
    if not host.is_pinned():
        raise ValueError("the host KV pool must be pinned for the device to read it")
    bf16 = host.dtype == torch.bfloat16  # no typestr for it: its bits travel as int16
    view = torch.as_tensor(_CudaArray(host.view(torch.int16) if bf16 else host), device=device)
    return view.view(host.dtype) if host.dtype == torch.bfloat16 else view


def download(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (host, pinned on a CUDA engine) <- src (device): non-blocking where it can be (the
    host must not read dst before the copy's stream has run it)."""
    dst.copy_(src, non_blocking=src.is_cuda and dst.is_pinned())
