"""The device block pool: which KV blocks are free, and each request's block table.

Placement keeps a request's blocks contiguous when it can (its next block is the one after its
last; a new request starts in the middle of the largest free run, leaving room for the request
before it to grow), because attention then reads the request's KV as a view of the pool instead
of gathering it. Correctness never depends on it: fragmented tables take the gather path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from oasiskv.sequence import Sequence


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.is_free = np.ones(num_blocks, dtype=bool)
        self.num_free = num_blocks
        self.peak_used = 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` in place so it covers `num_tokens` tokens."""
        need = self.blocks_for(num_tokens) - len(table)
        self._check_free(need)
        for _ in range(need):
            block = self._next_block(table[-1] if table else None)
            self.is_free[block] = False
            self.num_free -= 1
            table.append(block)
        self.peak_used = max(self.peak_used, self.num_used)

    def take_run(self, table: list[int], n: int) -> None:
        """Appends `n` blocks for a sparse request's fixed-size share (its device slab, its
        host history): the lowest free run of n blocks starting at a multiple of n, so that
        equal requests sit side by side at one stride and a batch of them is one strided view
        (else the lowest free run of n, else the lowest free blocks)."""
        if n <= 0:
            return
        self._check_free(n)
        starts, ends = self._free_runs()
        aligned = -(-starts // n) * n
        fits = np.flatnonzero(aligned + n <= ends)
        if len(fits):
            first = int(aligned[fits[0]])
        else:
            fits = np.flatnonzero(ends - starts >= n)
            first = int(starts[fits[0]]) if len(fits) else -1
        blocks = (list(range(first, first + n)) if first >= 0
                  else np.flatnonzero(self.is_free)[:n].tolist())
        self._take(table, blocks)

    def _check_free(self, n: int) -> None:
        if n > self.num_free:
            raise MemoryError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")

    def _take(self, table: list[int], blocks: list[int]) -> None:
        self.is_free[blocks] = False
        self.num_free -= len(blocks)
        table.extend(blocks)
        self.peak_used = max(self.peak_used, self.num_used)

    def free(self, table: list[int]) -> None:
        if table:
            self.is_free[table] = True
            self.num_free += len(table)
            table.clear()

    def _next_block(self, last: int | None) -> int:
        if last is not None and last + 1 < self.num_blocks and self.is_free[last + 1]:
            return last + 1
        start, length = self._largest_free_run()
        return start if start == 0 or last is not None else start + length // 2

    def _free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Starts and ends (exclusive) of the runs of free blocks, lowest first."""
        padded = np.concatenate(([False], self.is_free, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))  # starts at even, ends at odd indices
        return edges[0::2], edges[1::2]

    def _largest_free_run(self) -> tuple[int, int]:
        starts, ends = self._free_runs()
        i = int(np.argmax(ends - starts))
        return int(starts[i]), int(ends[i] - starts[i])


def is_contiguous(table: list[int]) -> bool:
    return not table or (table[-1] - table[0] == len(table) - 1
                         and all(b - a == 1 for a, b in zip(table, table[1:], strict=False)))


def block_runs(table: list[int]) -> list[tuple[int, int]]:
    """(first block, length) of each run of consecutive blocks of `table`, in order."""
    if not table:
        return []
    blocks = np.asarray(table)
    breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts, ends = np.concatenate(([0], breaks)), np.concatenate((breaks, [len(blocks)]))
    return [(int(blocks[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


class KVAllocator:
    """How many blocks of each tier a request holds for a number of tokens.

    dense: every block on the device, allocated as the request grows (a request that cannot
    grow preempts another). sparse: on the device a slab of K+2 blocks (working set, active
    and draft blocks: its block table) and a summary id (a row of the device's kmin/kmax
    tensors) for every block of its whole possible history; in the host tier that history.
    All are reserved at admission, so a running sparse request never needs more memory and is
    never preempted: recomputing it would lose its working-set history.

    Summary ids: on one node a block's summary id is its host block's id (the engine sizes the
    host pool to the summaries the device holds, `summaries` None); with a remote store they
    are their own pool, since a request whose prompt went to the store keeps only its host
    cache's blocks (`shrink_host`), while the summaries of all its blocks stay.
    `summary_room`: the summary ids the device budget holds beside the slabs (for messages:
    it tells a device limit from a host one).
    """

    def __init__(self, device: BlockPool, host: BlockPool | None = None,
                 slab_blocks: int | None = None, summaries: BlockPool | None = None,
                 summary_room: int | None = None) -> None:
        self.device, self.host, self.slab_blocks = device, host, slab_blocks
        self.summaries = summaries
        self.summary_room = summary_room

    @property
    def sparse(self) -> bool:
        return self.host is not None

    @property
    def summary_pool(self) -> BlockPool | None:
        """sparse: the pool whose ids index the device summaries (the host pool on one node)."""
        return self.summaries if self.summaries is not None else self.host

    def needs(self, seq: Sequence, num_tokens: int) -> tuple[int, int]:
        """Additional (device, host) blocks for `seq` to hold `num_tokens` tokens."""
        if not self.sparse:
            return self.device.blocks_for(num_tokens) - len(seq.block_table), 0
        tokens = max(num_tokens, seq.max_context)
        if seq.host_cache is not None:
            host = 0
        elif seq.host_budget is not None:
            host = seq.host_budget - len(seq.host_table)
        else:
            host = self.host.blocks_for(tokens) - len(seq.host_table)
        return self.slab_blocks - len(seq.block_table), host

    def _summary_need(self, seq: Sequence, num_tokens: int) -> int:
        if self.summaries is None:  # one node: a host block's id is its summary id
            return 0
        return self.summaries.blocks_for(max(num_tokens, seq.max_context)) - len(
            seq.summary_table)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        dev, host = self.needs(seq, num_tokens)
        summaries = self._summary_need(seq, num_tokens)
        return (self.device.can_allocate(dev) and (host <= 0 or self.host.can_allocate(host))
                and (summaries <= 0 or self.summaries.can_allocate(summaries)))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        if not self.sparse:
            self.device.grow(seq.block_table, num_tokens)
            return
        tokens = max(num_tokens, seq.max_context)
        if not seq.block_table:
            self.device.take_run(seq.block_table, self.slab_blocks)
        if seq.host_cache is None:
            budget = seq.host_budget
            if budget is None and not seq.host_table:  # its whole history, reserved at once
                self.host.take_run(seq.host_table, self.host.blocks_for(tokens))
            self.host.grow(seq.host_table,
                           tokens if budget is None else budget * self.host.block_size)
        if self.summaries is not None:
            if not seq.summary_table:  # side by side at one stride, as host histories are
                self.summaries.take_run(seq.summary_table, self.summaries.blocks_for(tokens))
            self.summaries.grow(seq.summary_table, tokens)

    def shrink_host(self, seq: Sequence, owned: list[int]) -> None:
        """The request's host cache took over: it keeps `owned` of its host blocks."""
        keep = set(owned)
        self.host.free([b for b in seq.host_table if b not in keep])
        seq.host_table = list(owned)

    def free(self, seq: Sequence) -> None:
        self.device.free(seq.block_table)
        if self.sparse:
            self.host.free(seq.host_table)
            if self.summaries is not None:
                self.summaries.free(seq.summary_table)
            seq.working_set = seq.host_cache = None

    def fits_alone(self, num_tokens: int, host_blocks: int | None = None) -> str | None:
        """None when one request of `num_tokens` fits the empty tiers, else the reason.
        `host_blocks`: a handed-over request's host budget (else its whole history)."""
        if not self.sparse:
            need, have = self.device.blocks_for(num_tokens), self.device.num_blocks
            return None if need <= have else (
                f"request needs up to {num_tokens} tokens of KV, the device KV budget holds "
                f"{have * self.device.block_size}; raise device_kv_budget or lower max_tokens")
        if self.slab_blocks > self.device.num_blocks:
            return (f"a sparse request needs {self.slab_blocks} device KV blocks for its slab "
                    f"(top_k + 2: working set, active and draft blocks), the device KV budget "
                    f"holds {self.device.num_blocks} beside the block summaries; raise "
                    f"device_kv_budget or lower top_k")
        ids = self.host.blocks_for(num_tokens)  # a summary id for every block of its history
        if ids > self.summary_pool.num_blocks and (self.summary_room is None
                                                   or ids > self.summary_room):
            return (f"a sparse request of up to {num_tokens} tokens needs the summaries of "
                    f"{ids} blocks on the device, the device KV budget holds "
                    f"{self.summary_pool.num_blocks} beside the slabs; raise device_kv_budget "
                    f"or lower max_tokens")
        if self.summaries is not None and ids > self.summaries.num_blocks:  # remote store: ids
            # for what host caches at f_host can hold
            return (f"a sparse request of up to {num_tokens} tokens needs {ids} summary ids, "
                    f"the engine keeps {self.summary_pool.num_blocks} (host_kv_budget's "
                    f"blocks / f_host); raise host_kv_budget or lower max_tokens")
        # the whole history passes through the host during prefill, remote store or not
        need = self.host.blocks_for(num_tokens) if host_blocks is None else host_blocks
        have = self.host.num_blocks
        return None if need <= have else (
            f"request needs up to {num_tokens} tokens of KV, the host KV budget holds "
            f"{have * self.host.block_size}; raise host_kv_budget or lower max_tokens")
