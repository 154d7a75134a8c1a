"""The decode-host cache of one sparse request over the remote tier (paper §3.2.3, "decode-host
LRU").

Once a request's prompt is in the remote store it owns exactly `budget` host blocks: one per
generated (not-yet-complete) logical block, fixed and never evicted, and `prompt_capacity`
shared by its complete prompt blocks. Each layer maps logical blocks to host blocks on its own
(`where[l, b]`, -1 = only in the remote store), because the pipeline selects and fetches misses
per layer. So the budget holds by construction at every instant; the LRU pass runs for each
layer in the remote stage, right before the fetch, and evicts only what the fetch needs room
for: the least recently selected prompt blocks outside every head's working set. An evicted block
stays in the store and is fetched again on a later miss (no approximation).

Only the owning layer's pipeline chain touches a layer's rows (select stamps, remote fetches),
so the per-layer state needs no lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def prompt_capacity(f_host: float, num_prompt: int, working_set: int) -> int:
    """Host blocks for a request's P complete prompt blocks: ceil(f_host*P), raised to the
    largest possible working set of a layer (K slots x Hkv heads, at most P): the paper's
    condition that the budget accommodates the protected working set, without which an
    admission could find no block to evict."""
    return min(num_prompt, max(math.ceil(f_host * num_prompt), working_set))


@dataclass
class HostCache:
    namespace: str  # the request's blocks in the remote store
    num_prompt: int  # P: complete prompt blocks, in the store, evictable
    prompt_slots: torch.Tensor  # [C] host blocks shared by the prompt blocks (C = capacity)
    holder: torch.Tensor  # [L, C] logical prompt block held by each prompt slot; -1 = empty
    where: torch.Tensor  # [L, n] host block of logical block b in layer l; -1 = remote only
    last_used: torch.Tensor  # [L, P] step when each prompt block was last predicted
    budget: int  # host blocks the request owns: C + its generated blocks
    peak: int = 0  # most prompt blocks resident in one layer, plus the generated blocks
    fetched: int = 0  # blocks (one layer's each) read from the store during decode
    error: str | None = None  # a remote fetch failed: the engine fails the request

    @classmethod
    def create(cls, namespace: str, host_table: list[int], num_layers: int, num_prompt: int,
               capacity: int) -> HostCache:
        """Right after the prompt went to the store: logical block b sits in host_table[b] in
        every layer. Keeps the `capacity` most recent prompt blocks (the others are dropped:
        the caller frees host_table[:num_prompt - capacity]) and every generated block."""
        n = len(host_table)
        table = torch.tensor(host_table, dtype=torch.long)
        kept = torch.arange(num_prompt - capacity, num_prompt)
        where = torch.full((num_layers, n), -1, dtype=torch.long)
        where[:, kept] = table[kept]
        where[:, num_prompt:] = table[num_prompt:]
        # older prompt blocks count as less recently used; any selection (step >= 1) is newer
        last_used = (torch.arange(num_prompt) - num_prompt).expand(num_layers, -1).clone()
        cache = cls(namespace, num_prompt, table[kept], kept.expand(num_layers, -1).clone(),
                    where, last_used, capacity + n - num_prompt)
        cache.peak = cache.resident()
        return cache

    @classmethod
    def received(cls, namespace: str, host_table: list[int], num_prompt: int, capacity: int,
                 resident: list[torch.Tensor]) -> HostCache:
        """A request handed over by a prefill worker: it owns `host_table` (capacity prompt
        slots, then one block per logical block from P on); layer l starts holding the
        logical prompt blocks resident[l] (at most capacity, first in the least recently
        used order)."""
        table = torch.tensor(host_table, dtype=torch.long)
        slots, generated = table[:capacity], table[capacity:]
        L = len(resident)
        where = torch.full((L, num_prompt + len(generated)), -1, dtype=torch.long)
        where[:, num_prompt:] = generated
        holder = torch.full((L, capacity), -1, dtype=torch.long)
        last_used = torch.zeros((L, num_prompt), dtype=torch.long)
        for layer, blocks in enumerate(resident):
            n = len(blocks)
            holder[layer, :n] = blocks
            where[layer, blocks] = slots[:n]
            last_used[layer, blocks] = torch.arange(n) - n  # older than any selection
        cache = cls(namespace, num_prompt, slots, holder, where, last_used,
                    capacity + len(generated))
        cache.peak = cache.resident()
        return cache

    @property
    def owned(self) -> list[int]:
        """Host blocks the request owns after the hand-over (what the allocator frees)."""
        return self.prompt_slots.tolist() + self.where[0, self.num_prompt:].tolist()

    def resident(self, layer: int | None = None) -> int:
        """Blocks on the host in `layer` (default: the fullest layer), generated ones included."""
        held = (self.holder >= 0).sum(1)  # [L]
        held = held.max() if layer is None else held[layer]
        return int(held) + self.where.shape[1] - self.num_prompt

    def layer_blocks(self) -> int:
        """Blocks (one layer's each) on the host now, summed over layers."""
        return int((self.holder >= 0).sum()) + self.where.numel() - self.where.shape[0] * (
            self.num_prompt)

    def touch(self, first: int, blocks: torch.Tensor, step: int) -> None:
        """Marks logical blocks [J, m] of layers first..first+J-1 (any, -2 padding allowed) as
        selected at `step`."""
        rows = torch.arange(len(blocks))[:, None].expand_as(blocks)
        prompt = (blocks >= 0) & (blocks < self.num_prompt)
        self.last_used[first:first + len(blocks)][rows[prompt], blocks[prompt]] = step

    def make_room(self, layers: torch.Tensor, incoming: torch.Tensor,
                  protected: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Host blocks for the prompt blocks `incoming` of `layers` ([m] each; pairs sorted
        by layer, distinct, not resident), evicting in each layer its least recently used
        resident prompt blocks outside `protected[layer]` (protected: [L, *] logical blocks
        of each layer's working sets; -1 entries ignored). All layers at once: a job's remote
        stage makes room in 15 or 30 layers of each request. The caller fills them. Returns
        (host blocks [m], evictions)."""
        first = int(layers[0])
        run = slice(first, int(layers[-1]) + 1)
        rows = layers - first  # [m]
        holder = self.holder[run]  # [J, C] view
        J, C = holder.shape
        wanted = torch.bincount(rows, minlength=J)  # [J]
        empty = holder < 0
        need = wanted - empty.sum(1)
        evicted = int(need.clamp(min=0).sum())
        if evicted:
            P = self.num_prompt
            marks = protected[run].flatten(1)
            marks = torch.where((marks >= 0) & (marks < P), marks, P)  # column P: ignored
            guard = torch.zeros(J, P + 1, dtype=torch.bool).scatter_(1, marks, True)
            movable = ~empty & ~guard.gather(1, holder.clamp(min=0))
            short = (movable.sum(1) < need).nonzero().flatten()
            if len(short):  # prompt_capacity() rules this out
                j = int(short[0])
                raise RuntimeError(f"host cache of {self.namespace!r}, layer {first + j}: "
                                   f"{int(wanted[j])} blocks to fetch, {int(empty[j].sum())} "
                                   f"free and {int(movable[j].sum())} evictable slots")
            age = torch.where(movable, self.last_used[run].gather(1, holder.clamp(min=0)),
                              torch.iinfo(torch.long).max)
            order = torch.argsort(age, dim=1, stable=True)  # [J, C] least recent first
            vrows, ranks = (torch.arange(C) < need[:, None]).nonzero(as_tuple=True)
            victims = order[vrows, ranks]
            self.where[run][vrows, holder[vrows, victims]] = -1
            holder[vrows, victims] = -1
            empty = holder < 0
        # the k-th incoming block of a layer takes the layer's k-th empty slot
        erows, cols = empty.nonzero(as_tuple=True)
        counts = empty.sum(1)
        rank = torch.arange(len(erows)) - (torch.cumsum(counts, 0) - counts)[erows]
        cols = cols[rank < wanted[erows]]
        holder[rows, cols] = incoming
        slots = self.prompt_slots[cols]
        self.where[run][rows, incoming] = slots
        self.peak = max(self.peak, self.resident())  # other layers are unchanged
        return slots, evicted

    def forget(self, layers: torch.Tensor, blocks: torch.Tensor) -> None:
        """Undoes make_room for blocks ([m] each) whose fetch failed: their host blocks hold
        nothing."""
        slots = self.where[layers, blocks]
        self.where[layers, blocks] = -1
        cols = (self.prompt_slots[None, :] == slots[:, None]).int().argmax(1)
        self.holder[layers, cols] = -1
