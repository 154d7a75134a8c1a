"""What must hold of an engine between steps, whatever failed before (tests check it after
every injected fault).

- requests: the engine's table holds exactly the scheduler's running and waiting requests,
  each once, none finished; every request added is live or counted once as finished/failed;
- blocks: in every tier (device, host, summary ids) no block is owned twice, every block of a
  live request is marked used, and the pool uses no block that no live request owns; waiting
  requests own none; a host cache maps only its request's host blocks;
- progress: a request's K/V covers at most its tokens but the last, within its blocks;
- device: the tensors device_kv_budget pays for take at most the budget; with dense_layers the
  dense layers' device copy has a block for each summary id (it is indexed by host blocks, so
  the host tier's check above catches its leaked blocks), and for every running request it
  holds what the host tier holds for its computed tokens (both written together);
- prefetch: no pending job touches a request that is not live (its blocks may be reused);
- remote store: its namespaces (where it can list them) belong to live requests (or to
  `foreign` ones: another engine's on a shared store) or are prefix-cache entries; the entries
  this engine owns take at most its prefix_cache_bytes. (An owned entry may be gone from the
  store: another engine evicted it, and its owner finds out when it evicts it or a read
  misses, `kv/prefix_cache.py`.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from oasiskv.engine.stats import device_tensors
from oasiskv.kv.blocks import BlockPool
from oasiskv.kv.prefix_cache import is_entry
from oasiskv.kv.remote_tier import RemoteTier, request_namespaces
from oasiskv.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from oasiskv.engine.engine import LLMEngine


class InvariantError(RuntimeError):
    """The engine's state is inconsistent; the message lists every broken invariant."""


def check_invariants(engine: LLMEngine, foreign: Iterable[str] = ()) -> None:
    problems = violations(engine, foreign)
    if problems:
        raise InvariantError("engine invariants broken:\n- " + "\n- ".join(problems))


def violations(engine: LLMEngine, foreign: Iterable[str] = ()) -> list[str]:
    sched = engine.scheduler
    live = list(sched.running) + list(sched.waiting)
    problems = (_requests(engine, live) + _blocks(engine, live) + _progress(engine, live)
                + _device(engine))
    sparse = engine.sparse
    if sparse is not None:
        live_ids = {id(s) for s in live}
        stale = {s.request_id for s in sparse.pipeline.pending_owners() if id(s) not in live_ids}
        if stale:
            problems.append(f"prefetch jobs still pending for ended requests {sorted(stale)}")
        if engine.remote is not None:
            problems += _store(engine.remote, live, set(foreign))
    return problems


def live_namespaces(engine: LLMEngine) -> set[str]:
    """The store namespaces that the engine's live requests hold."""
    sched = engine.scheduler
    return set().union(*(request_namespaces(s) for s in list(sched.running) + list(sched.waiting)))


def _requests(engine: LLMEngine, live: list[Sequence]) -> list[str]:
    problems = []
    ids = [s.request_id for s in live]
    if len(set(ids)) != len(ids):
        problems.append(f"a request is scheduled twice: {sorted(ids)}")
    table = engine.requests
    if set(table) != set(ids) or any(table.get(s.request_id) is not s for s in live):
        problems.append(f"request table {sorted(table)} is not the scheduler's live requests "
                        f"{sorted(ids)}")
    for want, seqs in ((SequenceStatus.RUNNING, engine.scheduler.running),
                       (SequenceStatus.WAITING, engine.scheduler.waiting)):
        for s in seqs:
            if s.status is not want or s.finish_reason is not None:
                problems.append(f"request {s.request_id} is {want.name.lower()} with status "
                                f"{s.status.name}, finish_reason {s.finish_reason!r}")
    c = engine.counters
    ended = c["requests_finished"] + c["requests_failed"]
    if c["requests_added"] != ended + len(live):
        problems.append(f"{c['requests_added']} requests added, {ended} ended and {len(live)} "
                        "live: a request was lost or ended twice")
    return problems


def _tiers(engine: LLMEngine) -> list[tuple[str, BlockPool, str]]:
    """(name, pool, the Sequence attribute holding a request's blocks of it)."""
    kv = engine.kv
    tiers = [("device", kv.device, "block_table")]
    if kv.host is not None:
        tiers.append(("host", kv.host, "host_table"))
    if kv.summaries is not None:
        tiers.append(("summary", kv.summaries, "summary_table"))
    return tiers


def _blocks(engine: LLMEngine, live: list[Sequence]) -> list[str]:
    problems = []
    for name, pool, attr in _tiers(engine):
        owner: dict[int, str] = {}
        for seq in live:
            table = getattr(seq, attr)
            if table and seq.status is SequenceStatus.WAITING:
                problems.append(f"waiting request {seq.request_id} owns {name} blocks")
            for b in table:
                if not 0 <= b < pool.num_blocks:
                    problems.append(f"request {seq.request_id} owns {name} block {b} outside "
                                    f"the pool [0, {pool.num_blocks})")
                    continue
                if b in owner:
                    problems.append(f"{name} block {b} is owned by requests {owner[b]} and "
                                    f"{seq.request_id}")
                owner[b] = seq.request_id
                if pool.is_free[b]:
                    problems.append(f"{name} block {b} of request {seq.request_id} is free")
        if pool.num_free != int(pool.is_free.sum()):
            problems.append(f"{name} pool counts {pool.num_free} free blocks, its map "
                            f"{int(pool.is_free.sum())}")
        if pool.num_used != len(owner):
            problems.append(f"{name} pool uses {pool.num_used} blocks, live requests own "
                            f"{len(owner)}: leaked blocks")
    for seq in live:
        cache = seq.host_cache
        if cache is not None:
            mapped = set(cache.prompt_slots.tolist()) | set(
                cache.where[cache.where >= 0].tolist())
            if not mapped <= set(seq.host_table):
                problems.append(f"host cache of request {seq.request_id} maps host blocks "
                                f"{sorted(mapped - set(seq.host_table))} it does not own")
    return problems


def _progress(engine: LLMEngine, live: list[Sequence]) -> list[str]:
    problems = []
    B, sparse = engine.kv.device.block_size, engine.kv.host is not None
    for seq in live:
        n = seq.num_computed_tokens
        if not 0 <= n < seq.num_tokens:
            problems.append(f"request {seq.request_id} has K/V for {n} of its {seq.num_tokens} "
                            "tokens (at most all but the last)")
        if seq.status is not SequenceStatus.RUNNING:
            continue
        if not sparse and len(seq.block_table) * B < n:
            problems.append(f"request {seq.request_id}: {len(seq.block_table)} device blocks "
                            f"cannot hold its {n} computed tokens")
        if sparse and len(seq.block_table) != engine.kv.slab_blocks:
            problems.append(f"request {seq.request_id} holds {len(seq.block_table)} slab "
                            f"blocks, not {engine.kv.slab_blocks}")
        if sparse and seq.host_cache is None and len(seq.host_table) * B < n:
            problems.append(f"request {seq.request_id}: {len(seq.host_table)} host blocks "
                            f"cannot hold its {n} computed tokens")
    return problems


def _device(engine: LLMEngine) -> list[str]:
    problems = []
    budget = engine.config.cache.device_kv_budget
    total = sum(t.numel() * t.element_size() for t in device_tensors(engine))
    if total > budget:
        problems.append(f"the device tensors take {total} B, more than device_kv_budget "
                        f"{budget} B")
    dense = engine.runner.dense_kv
    if dense is None:
        return problems
    B, ids = engine.kv.device.block_size, engine.kv.summary_pool.num_blocks
    if dense.shape[3] != ids * B:
        problems.append(f"the dense layers' copy holds {dense.shape[3] // B} blocks, the "
                        f"engine {ids} summary ids")
        return problems
    host = engine.runner.host_kv[:dense.shape[0]]
    for seq in engine.scheduler.running:
        if seq.prefix_kv is not None:  # its given K/V is written when it first runs
            continue
        n = seq.num_computed_tokens
        pos = torch.arange(n)
        slots = torch.tensor(seq.host_table, dtype=torch.long)[pos // B] * B + pos % B
        if not torch.equal(dense[:, :, :, slots.to(dense.device)].cpu(), host[:, :, :, slots]):
            problems.append(f"request {seq.request_id}: the dense layers' device copy differs "
                            f"from the host tier within its {n} computed tokens")
    return problems


def _store(remote: RemoteTier, live: list[Sequence], foreign: set[str]) -> list[str]:
    problems = []
    prefix = remote.prefix
    if prefix.bytes_held > prefix.capacity_bytes:
        problems.append(f"the prefix cache holds {prefix.bytes_held} bytes, over its "
                        f"capacity {prefix.capacity_bytes}")
    held = set(foreign).union(*(request_namespaces(s) for s in live))
    stored = remote.store.namespaces()
    if stored is None:
        return problems
    stray = {n for n in stored - held if not is_entry(n)}
    if stray:
        problems.append(f"the store holds namespaces {sorted(stray)} of no live request")
    return problems
