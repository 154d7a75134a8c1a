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

    def touch(self, layer: int, blocks: torch.Tensor, step: int) -> None:
        """Marks logical blocks (any, -2 padding allowed) as selected at `step`."""
        prompt = blocks[(blocks >= 0) & (blocks < self.num_prompt)]
        self.last_used[layer, prompt] = step

    def make_room(self, layer: int, incoming: torch.Tensor,
                  protected: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Host blocks for the prompt blocks `incoming` ([m], distinct, not resident in
        `layer`), evicting the least recently used resident prompt blocks not in `protected`
        (logical blocks of the layer's working sets; -1 entries ignored). The caller fills
        them. Returns (host blocks [m], evictions)."""
        holder = self.holder[layer]  # [C]
        free = (holder < 0).nonzero().flatten()
        need = len(incoming) - len(free)
        evicted = 0
        if need > 0:
            guard = torch.zeros(self.num_prompt, dtype=torch.bool)
            guard[protected[(protected >= 0) & (protected < self.num_prompt)]] = True
            held = holder >= 0
            movable = held & ~guard[holder.clamp(min=0)]
            if int(movable.sum()) < need:  # prompt_capacity() rules this out
                raise RuntimeError(f"host cache of {self.namespace!r}, layer {layer}: "
                                   f"{len(incoming)} blocks to fetch, {len(free)} free and "
                                   f"{int(movable.sum())} evictable slots")
            age = torch.where(movable, self.last_used[layer, holder.clamp(min=0)],
                              torch.iinfo(torch.long).max)
            victims = torch.argsort(age, stable=True)[:need]
            self.where[layer, holder[victims]] = -1
            holder[victims] = -1
            evicted = need
            free = (holder < 0).nonzero().flatten()
        idx = free[:len(incoming)]
        holder[idx] = incoming
        slots = self.prompt_slots[idx]
        self.where[layer, incoming] = slots
        self.peak = max(self.peak, self.resident(layer))
        return slots, evicted

    def forget(self, layer: int, blocks: torch.Tensor) -> None:
        """Undoes make_room for blocks whose fetch failed: their host blocks hold nothing."""
        slots = self.where[layer, blocks]
        self.where[layer, blocks] = -1
        self.holder[layer][torch.isin(self.prompt_slots, slots)] = -1
