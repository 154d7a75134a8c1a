"""The fetch cap: blocks admitted per KV head, layer and step once a working set is seeded
(paper §3.3.2), fixed by f_hbm or, with f_hbm=auto, retuned after every step to what one
forward pass can move at the local fetch's bandwidth, measured when the engine starts."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def block_bytes_per_head(kv: torch.Tensor, block_size: int) -> int:
    """K and V of one KV head's slice of one block of a pool [L, 2, Hkv, slots, d]."""
    return 2 * block_size * kv.shape[-1] * kv.element_size()


def measure_fetch_bandwidth(device_kv: torch.Tensor, host_kv: torch.Tensor, block_size: int,
                            slices: int = 512, repeats: int = 5) -> float:
    """Bytes/s of the local-fetch gather (per-head block slices host -> device, pools
    [L, 2, Hkv, slots, d]), timed on the pools' first slots before anything lives there (the
    best of `repeats`)."""
    B = block_size
    hkv = device_kv.shape[2]
    blocks = min(device_kv.shape[3], host_kv.shape[3]) // B
    n = min(slices, blocks * hkv)
    heads = (torch.arange(n) % hkv)[:, None]
    starts = (torch.arange(n) // hkv * B)[:, None] + torch.arange(B)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        device_kv[0][:, heads, starts] = host_kv[0][:, heads, starts]
        if device_kv.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n * block_bytes_per_head(device_kv, B) / best


@dataclass
class FetchCap:
    top_k: int
    value: int  # admissions per head, layer and step once seeded
    auto: bool = False  # f_hbm=auto: retuned after every step
    bandwidth: float = 0.0  # auto: bytes/s of a local fetch (measure_fetch_bandwidth)
    forward_s: float = 0.0  # auto: moving estimate of a decode step's forward time

    def retune(self, forward_s: float, unit_bytes: int) -> None:
        """After a step whose forward pass took `forward_s`: the cap whose admissions move in
        one forward pass (the moving estimate, 0.8 old + 0.2 new) at the measured bandwidth,
        in [1, top_k]. unit_bytes: what one unit of cap moves (one block-head's K/V in every
        layer, KV head and decoding request)."""
        if not self.auto:
            return
        self.forward_s = (forward_s if not self.forward_s
                          else 0.8 * self.forward_s + 0.2 * forward_s)
        cap = int(self.bandwidth * self.forward_s / unit_bytes)
        self.value = max(1, min(self.top_k, cap))
