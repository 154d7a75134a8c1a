"""The prefix cache: complete prompt blocks kept in the remote store under content-addressed
namespaces after their request ends, so that a later prompt that starts with them, on any
engine sharing the store (any prefill worker), reads their K/V instead of computing it.

Keys. Block b of a prompt (all layers) is the entry `pc:<h_b>`, h_b a digest of the engine's
model fingerprint and the prompt's tokens up to the end of block b (`prefix_hashes`), one store
block per layer (`BlockKey("pc:<h_b>", layer, 0)`). Two prompts share an entry exactly when
they share their first b+1 blocks, so an engine finds a prompt's longest cached prefix with one
`contains` call over its blocks' entries and reads it with one `get_blocks`: no engine keeps an
index of what the others put. The fingerprint (the model's config, dtype and a sample of every
weight) keeps engines of different models or dtypes on one store apart.

Capacity and eviction. Each engine keeps an LRU of the entries it put (`prefix_cache_bytes` of
them at most, L x block bytes each), refreshed when it reuses one, and removes the least recent
from the store to make room. So the capacity is per engine: a store shared by N prefill
workers holds at most N x prefix_cache_bytes of prefix cache. Why there: every entry has one
owner that evicts it, so the bound holds with no coordination, and the store needs nothing but
put/get/contains/remove (Mooncake has no atomic read-modify-write to keep a shared LRU in, and
its own eviction would drop live requests' blocks as readily as cached ones). The price: an
entry that worker A put and only worker B reuses ages in A's LRU; when A evicts it, B's next
such prompt computes the blocks and puts them again (B then owns them).

Within one prompt the deeper blocks are the older ones in the LRU (an entry is of use only with
all the shallower ones of its prompt), and a prompt caches at most as many of its leading
blocks as the capacity holds beside the ones of its prefix this engine already owns.

Races. An entry another engine evicts (or the store loses) between `contains` and `get` makes
the read fail: the prompt is computed as usual, and the entries the error names are removed
(a half-present entry would be found and fail every time). Two engines putting the same entry
put the same bytes (same model, same tokens); each counts it against its own capacity and
either's eviction removes it (the other's count is then high until it evicts it too).

Cost. The request's own namespace keeps its copy of the prompt blocks for its hand-over and the
decode worker's fetches (that copy leaves with the request; entries outlive it and no decode
worker reads them), so a prompt whose blocks are not cached yet is put twice: its new complete
blocks x L x block bytes more store memory (within the capacity) and as many more bytes put
(`prefix_put_bytes` in the engine's counters, beside `remote_put_bytes`).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from oasiskv.store.remote_store import BlockKey, RemoteStore, RemoteStoreError

log = logging.getLogger(__name__)
PREFIX = "pc:"  # no request namespace starts so (theirs: an 8-hex-digit engine tag, then "-")


def prefix_hashes(tokens: list[int], block_size: int, num_blocks: int,
                  seed: bytes = b"") -> list[str]:
    """For b < num_blocks, a digest of `seed` and tokens[:(b+1)*block_size]: equal exactly when
    two prompts share their first b+1 blocks (and their seed)."""
    running, out = hashlib.sha256(seed), []
    for b in range(num_blocks):
        chunk = tokens[b * block_size:(b + 1) * block_size]
        running.update(torch.tensor(chunk, dtype=torch.int64).numpy().tobytes())
        out.append(running.copy().hexdigest()[:32])
    return out


def model_fingerprint(model: nn.Module, dtype: torch.dtype) -> bytes:
    """A digest of the model's config, the K/V dtype, and the first and last values of every
    weight: engines that compute the same K/V for the same tokens share it, others do not."""
    h = hashlib.sha256(f"{getattr(model, 'config', '')!r} {dtype}".encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = torch.cat([flat[:8], flat[-8:]]).to("cpu", torch.float32)
        h.update(name.encode() + sample.numpy().tobytes())
    return h.digest()


def is_entry(namespace: str) -> bool:
    return namespace.startswith(PREFIX)


@dataclass
class PrefixCache:
    store: RemoteStore
    num_layers: int
    block_size: int
    capacity_bytes: int
    seed: bytes = b""  # model_fingerprint of the engine
    # the entries this engine put and has not evicted, least recently used first
    lru: OrderedDict[str, None] = field(default_factory=OrderedDict)
    evictions: int = 0  # entries this engine removed to make room
    bytes_put: int = 0  # what its puts moved to the store

    @property
    def entry_bytes(self) -> int:
        return self.num_layers * self.store.block_bytes

    @property
    def bytes_held(self) -> int:
        return len(self.lru) * self.entry_bytes

    def entries(self, tokens: list[int], num_blocks: int) -> list[str]:
        """The entry of each of the first num_blocks complete blocks of `tokens`."""
        return [PREFIX + h for h in prefix_hashes(tokens, self.block_size, num_blocks,
                                                  self.seed)]

    def _present(self, names: list[str]) -> list[bool]:
        # one probe per entry: puts are whole entries, and a partial one fails its read
        return self.store.contains([BlockKey(n, 0, 0) for n in names]) if names else []

    def find(self, prompt: list[int]) -> list[str]:
        """The entries of the longest cached run of complete blocks that starts the prompt and
        leaves its last token (which the prompt's first step computes)."""
        names = self.entries(prompt, (len(prompt) - 1) // self.block_size)
        try:
            present = self._present(names)
        except RemoteStoreError:
            return []
        found = present.index(False) if False in present else len(present)
        return names[:found]

    def read(self, names: list[str]) -> torch.Tensor | None:
        """K/V [L, 2, Hkv, m*B, d] of the m entries, or None when the read fails (the entries
        the error names leave the store and the LRU)."""
        L = self.num_layers
        keys = [BlockKey(n, layer, 0) for layer in range(L) for n in names]
        try:
            out = self.store.get_blocks(keys)  # [L*m, 2, Hkv, B, d]
        except RemoteStoreError as e:
            for name in {k.namespace for k in e.keys if isinstance(k, BlockKey)}:
                self._drop(name)
            return None
        self.touch(names)
        m, (_, hkv, B, d) = len(names), out.shape[1:]
        return out.view(L, m, 2, hkv, B, d).permute(0, 2, 3, 1, 4, 5).reshape(L, 2, hkv,
                                                                           m * B, d)

    def touch(self, names: list[str]) -> None:
        """Marks the entries of one prompt used now, the shallowest the most recent."""
        for name in reversed(names):
            if name in self.lru:
                self.lru.move_to_end(name)

    def add(self, tokens: list[int], blocks: torch.Tensor) -> int:
        """After a request's prompt blocks went to its own namespace: caches those of its
        P complete blocks (`blocks` [L, P, 2, Hkv, B, d]) that no entry holds yet, as many
        leading ones as the capacity allows, evicting the least recent entries to make room.
        Best effort: a put that fails leaves nothing behind and caches nothing. Returns the
        entries put."""
        P = blocks.shape[1]
        fits = self.capacity_bytes // self.entry_bytes
        if not P or not fits:
            return 0
        names = self.entries(tokens, P)
        try:
            present = self._present(names)
        except RemoteStoreError:
            return 0
        # the leading blocks this engine can own: each one it owns or would put counts
        keep, counted = 0, 0
        for name, there in zip(names, present, strict=True):
            counted += (not there) or name in self.lru
            if counted > fits:
                break
            keep += 1
        new = [b for b in range(keep) if not present[b]]
        self.touch(names[:keep])  # the prompt's own entries are not evicted for it
        self.evict(len(self.lru) * self.entry_bytes + len(new) * self.entry_bytes
                   - fits * self.entry_bytes)
        if new:
            keys = [BlockKey(names[b], layer, 0) for b in new for layer in range(self.num_layers)]
            try:
                self.store.put_blocks(keys, blocks[:, new].transpose(0, 1).reshape(
                    len(keys), *blocks.shape[2:]))
                self.bytes_put += len(keys) * self.store.block_bytes
            except RemoteStoreError as e:
                log.info("prefix cache: caching %d blocks failed (%s); not cached", len(new), e)
                for b in new:
                    self._remove(names[b])
                new = []
            self.lru.update((names[b], None) for b in new)
        self.touch(names[:keep])
        return len(new)

    def evict(self, nbytes: int) -> int:
        """Removes the least recent entries, at least `nbytes` of them if there are; returns
        the bytes freed."""
        freed = 0
        while self.lru and freed < nbytes:
            name, _ = self.lru.popitem(last=False)
            self._remove(name)
            self.evictions += 1
            freed += self.entry_bytes
        return freed

    def _drop(self, name: str) -> None:
        self.lru.pop(name, None)
        self._remove(name)

    def _remove(self, name: str) -> None:
        try:
            self.store.remove(name)
        except RemoteStoreError:  # a store that is gone holds nothing worth removing
            pass
