"""The remote tier under the decode-host cache: puts a request's complete prompt blocks when its
prefill is done, and fetches host misses for a layer, coalesced across the batch's requests.

Store keys are (namespace = request id, layer, logical block), one block `[2, Hkv, B, d]` per
key, so a layer's remote stage fetches exactly the blocks its admissions miss. A failing fetch
fails only the requests whose blocks failed: the error names keys, and their namespaces say
whose; an error naming none is narrowed down by fetching each request's blocks alone.

Beside its request's namespace a prompt's complete blocks also go to the prefix cache, where
they outlive the request and any engine on the store finds them by content
(`kv/prefix_cache.py`). A put that finds the store full first evicts this engine's least recent
prefix-cache entries; a put that fails leaves nothing of itself behind.
"""

from __future__ import annotations

import hashlib
import os
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from oasiskv.kv.host_cache import HostCache, prompt_capacity
from oasiskv.kv.prefix_cache import PrefixCache
from oasiskv.sequence import Sequence
from oasiskv.store.mooncake_store import MooncakeStore
from oasiskv.store.remote_store import (
    BlockKey,
    InProcessStore,
    RemoteStore,
    RemoteStoreError,
    StoreFull,
)

if TYPE_CHECKING:
    from oasiskv.kv.handoff import Handoff

_SHARED: weakref.WeakValueDictionary[str, InProcessStore] = weakref.WeakValueDictionary()


def open_store(spec: str, block_shape: tuple[int, int, int, int], dtype: torch.dtype,
               lend_bytes: int = 256 << 20) -> RemoteStore | None:
    """CacheConfig.remote_store -> a store (None for "none"). "inprocess://NAME" is one store
    shared by the engines of this process that name it (a prefill and a decode engine)."""
    if spec == "none":
        return None
    if spec == "inprocess":
        return InProcessStore(block_shape, dtype)
    if spec.startswith("inprocess://"):
        store = _SHARED.get(spec)
        if store is None:
            store = _SHARED[spec] = InProcessStore(block_shape, dtype)
        elif (store.block_shape, store.dtype) != (tuple(block_shape), dtype):
            raise ValueError(f"{spec} holds blocks {store.block_shape} {store.dtype}, this "
                             f"engine's are {tuple(block_shape)} {dtype}")
        return store
    # This host's address as peers reach it, and the transport; only tcp on 127.0.0.1 has
    # run (both PD workers start on one host, README).
    env = os.environ
    return MooncakeStore(block_shape, dtype, spec.removeprefix("mooncake://"),
                         segment_bytes=lend_bytes,
                         local_hostname=env.get("OASISKV_MOONCAKE_HOSTNAME", "127.0.0.1"),
                         protocol=env.get("OASISKV_MOONCAKE_PROTOCOL", "tcp"),
                         rdma_devices=env.get("OASISKV_MOONCAKE_RDMA_DEVICES", ""))


def namespace_for(engine_tag: str, request_id: str) -> str:
    """The store namespace of a request: the engine's tag (engines sharing a store must not
    read each other's request ids) and the request id, or a digest of it."""
    namespace = f"{engine_tag}-{request_id}"
    try:
        BlockKey(namespace, 0, 0)
    except ValueError:
        return f"{engine_tag}-h" + hashlib.sha1(request_id.encode()).hexdigest()[:20]
    return namespace


def request_namespaces(seq: Sequence) -> set[str]:
    """The store namespaces a request holds: its prompt blocks (put after its prefill, or
    handed over to it) and a hand-over's slab not yet taken."""
    handoff = seq.handoff
    out = {seq.host_cache.namespace} if seq.host_cache is not None else set()
    if handoff is not None:
        out |= {handoff.namespace} | ({handoff.slab_namespace} - {None})
    return out


@dataclass
class FetchResult:
    blocks: int = 0  # blocks read from the store
    bytes: int = 0
    evictions: int = 0  # prompt blocks dropped from host caches to make room


@dataclass(eq=False)  # compared by identity
class _Want:
    cache: HostCache
    layers: torch.Tensor  # [m] layer of each block to fetch
    blocks: torch.Tensor  # [m] logical blocks to fetch
    slots: torch.Tensor  # [m] host blocks they go to


@dataclass
class RemoteTier:
    store: RemoteStore
    host_kv: torch.Tensor  # [L, 2, Hkv, host_slots, d] the host tier the caches live in
    block_size: int
    f_host: float
    working_set: int  # K * Hkv: most distinct blocks one layer's working sets can hold
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # this engine's namespaces
    prefix_cache_bytes: int = 0  # what this engine's prefix-cache entries may take
    seed: bytes = b""  # the model's fingerprint (prefix_cache.model_fingerprint)
    prefix: PrefixCache = field(init=False)
    _arange: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self._arange = torch.arange(self.block_size)
        self.prefix = PrefixCache(self.store, self.host_kv.shape[0], self.block_size,
                                  self.prefix_cache_bytes, self.seed)

    def namespace(self, request_id: str) -> str:
        return namespace_for(self.tag, request_id)

    def capacity(self, num_prompt: int) -> int:
        return prompt_capacity(self.f_host, num_prompt, self.working_set)

    def _tokens(self, slots: torch.Tensor) -> torch.Tensor:
        return (slots[:, None] * self.block_size + self._arange).flatten()

    def put_prompt(self, seq: Sequence) -> HostCache:
        """Puts the request's complete prompt blocks (all layers) to the store, caches the ones
        no prefix-cache entry holds yet, and returns its host cache; the caller frees the host
        blocks the cache does not own. A full store first gives up this engine's least recent
        prefix-cache entries; raises RemoteStoreError (StoreFull: no room even so) when the
        put fails, having removed what of it arrived."""
        B, L = self.block_size, self.host_kv.shape[0]
        P = seq.num_prompt_tokens // B
        namespace = self.namespace(seq.request_id)
        if P:
            kv = self.host_kv[:, :, :, self._tokens(torch.tensor(seq.host_table[:P]))]
            blocks = kv.unflatten(3, (P, B)).permute(0, 3, 1, 2, 4, 5)  # [L, P, 2, Hkv, B, d]
            keys = [BlockKey(namespace, layer, b) for layer in range(L) for b in range(P)]
            data = blocks.reshape(L * P, *blocks.shape[2:])
            try:
                self._put_making_room(namespace, keys, data)
            except RemoteStoreError:
                self.remove(namespace)  # what arrived: never half-stored
                raise
            self.prefix.add(seq.token_ids, blocks)
        return HostCache.create(namespace, seq.host_table, L, P, self.capacity(P))

    def _put_making_room(self, namespace: str, keys: list[BlockKey], data: torch.Tensor
                         ) -> None:
        try:
            self.store.put_blocks(keys, data)
        except StoreFull:
            # the prefix cache gives way to a request: its least recent entries, as many
            # bytes as the put needs (or all it has), then one more try
            if not self.prefix.evict(len(keys) * self.store.block_bytes):
                raise
            self.remove(namespace)
            self.store.put_blocks(keys, data)

    def reusable_prefix(self, prompt: list[int]) -> torch.Tensor | None:
        """K/V [L, 2, Hkv, m*B, d] of the longest run of complete blocks that starts the prompt
        (leaving its last token) and that the prefix cache holds (any engine's entries on this
        store), read from there; None when there is none, or when the read fails (the blocks
        left the store: the prompt is computed as usual)."""
        found = self.prefix.find(prompt)
        return self.prefix.read(found) if found else None

    def receive(self, seq: Sequence, namespace: str, blocks: list[torch.Tensor],
                keep: list[torch.Tensor]) -> tuple[HostCache, int]:
        """A handed-over request, its host blocks allocated: reads each layer's `blocks`
        ([m_l] logical prompt blocks) from the store in one call and keeps `keep[l]` (a
        subset, at most the capacity) in its host cache. Returns (cache, bytes read). Raises
        RemoteStoreError when the read fails."""
        P = seq.num_prompt_tokens // self.block_size
        cache = HostCache.received(namespace, seq.host_table, P, self.capacity(P), keep)
        keys = [BlockKey(namespace, layer, int(b))
                for layer, got in enumerate(blocks) for b in got]
        if not keys:
            return cache, 0
        out = self.store.get_blocks(keys)  # [n, 2, Hkv, B, d]
        start = 0
        for layer, got in enumerate(blocks):
            mine = out[start:start + len(got)]
            start += len(got)
            kept = torch.isin(got, keep[layer])
            slots = cache.where[layer, got[kept]]
            self.host_kv[layer][:, :, self._tokens(slots)] = \
                mine[kept].permute(1, 2, 0, 3, 4).flatten(2, 3)
        return cache, len(keys) * self.store.block_bytes

    def put_slab(self, namespace: str, slab: torch.Tensor) -> str:
        """Slab transfer, prefill side: a handed-over request's slab [L, K, 2, Hkv, B, d]
        goes to the store, slot s of layer l as block (l, s) of its own namespace, which the
        decode worker reads once (take_slab). Returns that namespace; raises
        RemoteStoreError when the put fails."""
        L, K = slab.shape[:2]
        slab_namespace = f"{namespace}.slab"
        keys = [BlockKey(slab_namespace, layer, s) for layer in range(L) for s in range(K)]
        try:
            self.store.put_blocks(keys, slab.reshape(L * K, *slab.shape[2:]))
        except RemoteStoreError:
            self.remove(slab_namespace)  # what did arrive
            raise
        return slab_namespace

    def take_slab(self, slab_namespace: str, num_layers: int, top_k: int) -> torch.Tensor:
        """Decode side: reads a slab that put_slab stored ([L, K, 2, Hkv, B, d]) and drops it
        from the store. Raises RemoteStoreError when the read fails."""
        keys = [BlockKey(slab_namespace, layer, s)
                for layer in range(num_layers) for s in range(top_k)]
        try:
            slab = self.store.get_blocks(keys)
        finally:  # read once: a failed read leaves nothing behind either
            self.remove(slab_namespace)
        return slab.view(num_layers, top_k, *slab.shape[1:])

    def fetch(self, wants: list[tuple[HostCache, torch.Tensor, torch.Tensor, torch.Tensor]]
              ) -> FetchResult:
        """For each (cache, layers [m], blocks [m], protected [L, *]): the logical prompt
        blocks (layers[i], blocks[i]) that are not on the host get host blocks (LRU eviction
        outside protected[layer], each layer's working sets) and are read from the store, in
        one call for all requests and layers (a store call costs far more than a block: 0.3 ms
        for 1 block, 2.4 for 24 over Mooncake's TCP here). A request whose read fails gets
        `cache.error`, and its blocks stay off the host."""
        result = FetchResult()
        plan = []
        for cache, layers, blocks, protected in wants:
            n = cache.where.shape[1]
            pairs = torch.unique(layers * n + blocks)  # distinct, sorted by layer
            layers, blocks = pairs // n, pairs % n
            missing = cache.where[layers, blocks] < 0
            if missing.any():
                layers, blocks = layers[missing], blocks[missing]
                slots, evicted = cache.make_room(layers, blocks, protected)
                result.evictions += evicted
                plan.append(_Want(cache, layers, blocks, slots))
        for want, error in self._get(plan, result):
            want.cache.forget(want.layers, want.blocks)
            lo, hi = int(want.layers.min()), int(want.layers.max())
            where = f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
            want.cache.error = (f"remote tier: fetching blocks of {where} failed: "
                                f"{type(error).__name__}: {error}")
        return result

    def _get(self, plan: list[_Want], result: FetchResult
             ) -> list[tuple[_Want, RemoteStoreError]]:
        """Reads the plan's blocks into their host blocks; returns the wants that failed."""
        if not plan:
            return []
        keys = [BlockKey(w.cache.namespace, layer, b) for w in plan
                for layer, b in zip(w.layers.tolist(), w.blocks.tolist(), strict=True)]
        try:
            out = self.store.get_blocks(keys)  # [n, 2, Hkv, B, d]
        except RemoteStoreError as e:
            named = {k.namespace for k in e.keys if isinstance(k, BlockKey)}
            blamed = [w for w in plan if w.cache.namespace in named]
            if not blamed and len(plan) > 1:  # no key named: each request's blocks alone
                return [f for w in plan for f in self._get([w], result)]
            blamed = blamed or plan
            rest = [w for w in plan if w not in blamed]
            return [(w, e) for w in blamed] + self._get(rest, result)
        B = self.block_size
        layers = torch.cat([w.layers for w in plan]).repeat_interleave(B)  # [n*B]
        tokens = self._tokens(torch.cat([w.slots for w in plan]))  # [n*B]
        # [L, host tokens, 2, Hkv, d] view: (layer, token) pairs index whole rows
        self.host_kv.permute(0, 3, 1, 2, 4)[layers, tokens] = \
            out.permute(0, 3, 1, 2, 4).flatten(0, 1)
        result.blocks += len(keys)
        result.bytes += len(keys) * self.store.block_bytes
        for w in plan:
            w.cache.fetched += len(w.blocks)
        return []

    def remove(self, namespace: str) -> None:
        """Drops a finished request's blocks from the store (best effort: a store that is
        gone keeps nothing worth removing)."""
        try:
            self.store.remove(namespace)
        except RemoteStoreError:
            pass

    def drop_request(self, seq: Sequence) -> None:
        """A request that ended (not handed over): whatever it holds in the store leaves."""
        for namespace in request_namespaces(seq):
            self.remove(namespace)

    def drop_handoff(self, handoff: Handoff) -> None:
        """A hand-over that will not be received: its blocks (and slab) leave the store."""
        self.remove(handoff.namespace)
        if handoff.slab_namespace is not None:
            self.remove(handoff.slab_namespace)

    def close(self) -> None:
        self.store.close()
