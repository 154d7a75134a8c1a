"""The device block pool: which KV blocks are free, and each request's block table.

Placement keeps a request's blocks contiguous when it can (its next block is the one after its
last; a new request starts in the middle of the largest free run, leaving room for the request
before it to grow), because attention then reads the request's KV as a view of the pool instead
of gathering it. Correctness never depends on it: fragmented tables take the gather path.
"""

import numpy as np


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
        if need > self.num_free:
            raise MemoryError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")
        for _ in range(need):
            block = self._next_block(table[-1] if table else None)
            self.is_free[block] = False
            self.num_free -= 1
            table.append(block)
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

    def _largest_free_run(self) -> tuple[int, int]:
        padded = np.concatenate(([False], self.is_free, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))  # starts at even, ends at odd indices
        starts, ends = edges[0::2], edges[1::2]
        i = int(np.argmax(ends - starts))
        return int(starts[i]), int(ends[i] - starts[i])


def is_contiguous(table: list[int]) -> bool:
    return not table or (table[-1] - table[0] == len(table) - 1
                         and all(b - a == 1 for a, b in zip(table, table[1:], strict=False)))
