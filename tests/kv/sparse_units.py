"""A SparseKV small enough to check by hand, for the unit tests of its modules: one layer, two
KV heads, d = 1, blocks of B = 2 tokens, K = 2 working slots. The host tier's key of KV head h
at token slot t is 100*h + t, its value 1000 + 100*h + t; the device pool starts as NaN (so
that every slot a test expects to be written is checked to be)."""

from types import SimpleNamespace

import torch

from oasiskv.config import CacheConfig
from oasiskv.kv.residency import SparseKV

L, HKV, D, B, K = 1, 2, 1, 2, 2


def host_value(kv: int, head: int, token: int) -> float:
    return 1000 * kv + 100 * head + token


def make_kv(device_blocks: int = 8, host_blocks: int = 8, **cfg) -> SparseKV:
    config = CacheConfig(kv_mode="sparse", block_size=B, top_k=K, f_hbm=1.0, prefetch="sync",
                         **{"rerank": 0, **cfg})
    t = host_blocks * B
    host = torch.tensor([[[host_value(kv, h, s) for s in range(t)] for h in range(HKV)]
                         for kv in range(2)], dtype=torch.float32)
    host = host[None, ..., None]  # [L, 2, Hkv, t, d]
    device = torch.full((L, 2, HKV, device_blocks * B, D), float("nan"))
    summaries = torch.zeros(L, host_blocks, HKV, D)
    return SparseKV(config, device, host, summaries.clone(), summaries.clone())


def make_seq(block_table: list[int], host_table: list[int], pos: int,
             summary_ids: list[int] | None = None) -> SimpleNamespace:
    """What SparseKV reads of a request: its slab (block_table), host blocks, summary ids
    (the host blocks unless given: one node) and progress."""
    return SimpleNamespace(block_table=block_table, host_table=host_table,
                           summary_ids=list(host_table) if summary_ids is None else summary_ids,
                           host_cache=None, working_set=None, num_computed_tokens=pos,
                           request_id="r", draft_weights=None)


def device(kv: SparseKV, which: int, head: int, tokens: list[int]) -> list[float]:
    """The device pool's K (which=0) or V (1) of a head at some token slots."""
    return kv.device_kv[0, which, head, tokens, 0].tolist()
