"""The remote KV tier: whole KV blocks keyed by (namespace, layer, block), moved in batches.

The remote tier holds a request's complete prompt KV outside the decode host (DESIGN.md s5), so
the decode host can keep a bounded cache and fetch misses again instead of approximating.
One block is `[2, Hkv, B, d]` (K then V, all KV heads, B token positions) of one fixed dtype;
batches are `[n, 2, Hkv, B, d]`. A namespace is a request id (private blocks) or a prefix hash
(complete prompt blocks shared by requests with the same prefix).

Backends: `InProcessStore` (a dict of CPU tensors: the single-node default) and `MooncakeStore`
(a Mooncake Store client: multi-machine). Every store counts the bytes it moved (`bytes_put`,
`bytes_got`), the figures the benchmarks print.

Pointing MooncakeStore at a multi-machine deployment: run `mooncake_master
-rpc_address=<master ip> -rpc_port=50051` on one host; on every worker construct
`MooncakeStore(shape, dtype, master_addr="<master ip>:50051", local_hostname="<this host's ip,
reachable by the others>", protocol="rdma" (or "tcp"), rdma_devices="" (auto) or "mlx5_0",
segment_bytes=<memory this worker lends to the pool; 0 for a pure reader>)`. Metadata stays
P2PHANDSHAKE, so no etcd or HTTP metadata server is needed. Objects live in the segment of the
client that put them (or any mounted segment): if that process dies its blocks are gone, and
reads fail with RemoteStoreError once the master notices (client_ttl, default 10 s).
Run the master with its eviction off (`-eviction_ratio=0 -eviction_high_watermark_ratio=1.0`,
as `store/mooncake.py` starts it): by default it drops the oldest objects past its high
watermark, live requests' blocks too, and an evicted block reads as missing.

A full store refuses a put with `StoreFull` (InProcessStore past its optional `capacity_bytes`;
Mooncake's code -200 NO_AVAILABLE_HANDLE, no room in any mounted segment), and the put's
caller removes what of it arrived (`kv/remote_tier.py`), so no prompt is half-stored.
"""

from __future__ import annotations

import abc
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from oasiskv.store.errors import (
    FULL_CODES,
    TRANSIENT_CODES,
    RemoteStoreError,
    StoreFull,
    StoreUnreachable,
    describe_keys,
)

_NAMESPACE = re.compile(r"[A-Za-z0-9_.:@=+-]+")
_KEY = re.compile(r"(?P<ns>[A-Za-z0-9_.:@=+-]+)/L(?P<layer>\d+)/B(?P<block>\d+)")


@dataclass(frozen=True, order=True)
class BlockKey:
    """One block of one layer of a namespace (request id or prefix hash)."""

    namespace: str
    layer: int
    block: int

    def __post_init__(self) -> None:
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} must match {_NAMESPACE.pattern} "
                             "(it becomes part of a store key and of a removal regex)")
        if self.layer < 0 or self.block < 0:
            raise ValueError(f"layer and block must be >= 0, got {self.layer}, {self.block}")

    def __str__(self) -> str:
        return f"{self.namespace}/L{self.layer}/B{self.block}"

    @classmethod
    def parse(cls, text: str) -> BlockKey:
        m = _KEY.fullmatch(text)
        if m is None:
            raise ValueError(f"not a block key: {text!r}")
        return cls(m["ns"], int(m["layer"]), int(m["block"]))


class RemoteStore(abc.ABC):
    """Whole KV blocks in batches. Subclasses implement `_put`/`_get` on validated, counted
    batches; put overwrites an existing key; get of a missing key raises RemoteStoreError."""

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype) -> None:
        block_shape = tuple(int(x) for x in block_shape)
        if len(block_shape) != 4 or block_shape[0] != 2 or min(block_shape) <= 0:
            raise ValueError(f"block_shape must be [2, Hkv, B, d], got {list(block_shape)}")
        self.block_shape: tuple[int, int, int, int] = block_shape  # type: ignore[assignment]
        self.dtype = dtype
        self.block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        self.bytes_put = 0
        self.bytes_got = 0
        self.capacity_bytes: int | None = None  # the most it holds, where the client knows it

    def _check(self, keys: Sequence[BlockKey], blocks: torch.Tensor, what: str) -> None:
        want = (len(keys), *self.block_shape)
        if tuple(blocks.shape) != want or blocks.dtype != self.dtype:
            raise ValueError(f"{what} must be {list(want)} {self.dtype}, "
                             f"got {list(blocks.shape)} {blocks.dtype}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"{what}: duplicate keys in one batch")

    def put_blocks(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> None:
        """Stores blocks[i] (`[n, 2, Hkv, B, d]`, any device) under keys[i]."""
        keys = list(keys)
        self._check(keys, blocks, "blocks")
        if keys:
            self._put(keys, blocks.detach())
            self.bytes_put += len(keys) * self.block_bytes

    def get_blocks(self, keys: Sequence[BlockKey], out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Reads keys[i] into out[i] (`[n, 2, Hkv, B, d]`; allocated on CPU when None)."""
        keys = list(keys)
        if out is None:
            out = torch.empty((len(keys), *self.block_shape), dtype=self.dtype)
        self._check(keys, out, "out")
        if keys:
            self._get(keys, out)
            self.bytes_got += len(keys) * self.block_bytes
        return out

    def __contains__(self, key: BlockKey) -> bool:
        return self.contains([key])[0]

    @abc.abstractmethod
    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is stored (a prefix-reuse probe)."""

    @abc.abstractmethod
    def remove(self, namespace: str) -> int:
        """Drops every block of a request or prefix; returns how many were removed."""

    def namespaces(self) -> set[str] | None:
        """The namespaces that hold blocks, where the backend can list them (else None)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Releases the backend's resources; the store is unusable afterwards."""

    @abc.abstractmethod
    def _put(self, keys: list[BlockKey], blocks: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _get(self, keys: list[BlockKey], out: torch.Tensor) -> None: ...

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessStore(RemoteStore):
    """The single-node default: a dict of CPU block copies (`[2, Hkv, B, d]` each).
    `capacity_bytes` (None: unbounded) bounds what it holds: a put that does not fit raises
    StoreFull and stores none of its blocks."""

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype,
                 capacity_bytes: int | None = None) -> None:
        super().__init__(block_shape, dtype)
        self.capacity_bytes = capacity_bytes
        self._blocks: dict[BlockKey, torch.Tensor] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def bytes_held(self) -> int:
        return len(self._blocks) * self.block_bytes

    def _put(self, keys: list[BlockKey], blocks: torch.Tensor) -> None:
        # Own copies (one allocation per block), so removing a block frees exactly its memory.
        copies = [b.to("cpu", copy=True, memory_format=torch.contiguous_format)
                  for b in blocks.unbind(0)]
        with self._lock:
            if self.capacity_bytes is not None:  # overwrites take no new room
                need = sum(k not in self._blocks for k in keys) * self.block_bytes
                free = self.capacity_bytes - self.bytes_held
                if need > free:
                    raise StoreFull(f"remote store is full: {len(keys)} blocks need {need} "
                                    f"bytes, {free} of its capacity {self.capacity_bytes} "
                                    f"bytes are free", keys[:1], [None])
            self._blocks.update(zip(keys, copies, strict=True))

    def _get(self, keys: list[BlockKey], out: torch.Tensor) -> None:
        with self._lock:
            found = [self._blocks.get(k) for k in keys]
        missing = [k for k, b in zip(keys, found, strict=True) if b is None]
        if missing:
            none = [None] * len(missing)
            raise RemoteStoreError(f"remote store has no block {describe_keys(missing, none)}",
                                   missing, none)
        for i, block in enumerate(found):
            out[i].copy_(block)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            return [k in self._blocks for k in keys]

    def namespaces(self) -> set[str]:
        with self._lock:
            return {k.namespace for k in self._blocks}

    def remove(self, namespace: str) -> int:
        with self._lock:
            gone = [k for k in self._blocks if k.namespace == namespace]
            for k in gone:
                del self._blocks[k]
        return len(gone)

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()


class MooncakeStore(RemoteStore):
    """A Mooncake Store client (see the module docstring for multi-machine use).

    Data moves with the zero-copy batch calls (`batch_upsert_from`, `batch_get_into`) between
    registered host memory and the pool: a registered staging buffer of `max_batch_blocks`
    blocks, or directly the caller's tensor when it lies in memory registered with
    `register_memory` (e.g. the decode host's block cache). Failed keys are retried while their
    code is transient, at most `retries` times and never past `deadline_s` (one Mooncake call
    that has already started can add its own ~4.5 s when the master is gone).
    """

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype, master_addr: str, *,
                 local_hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE",
                 protocol: str = "tcp", rdma_devices: str = "", segment_bytes: int = 256 << 20,
                 local_buffer_bytes: int = 16 << 20, key_prefix: str = "oasiskv",
                 max_batch_blocks: int = 64, retries: int = 5, deadline_s: float = 10.0
                 ) -> None:
        from oasiskv.store.mooncake import port_open, require_mooncake

        super().__init__(block_shape, dtype)
        if not _NAMESPACE.fullmatch(key_prefix):
            raise ValueError(f"key_prefix {key_prefix!r} must match {_NAMESPACE.pattern}")
        self.master_addr = master_addr
        self.key_prefix = key_prefix
        self.retries = retries
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []  # registered [start, end) host addresses
        self._client = None
        store_mod = require_mooncake()
        host, _, port = master_addr.rpartition(":")
        # Mooncake's setup() retries an unreachable master 20 times (~90 s): fail fast instead.
        if not port.isdigit() or not port_open(host.strip("[]"), int(port), 2.0):
            raise StoreUnreachable(f"remote_store: Mooncake master {master_addr} is not "
                                   "reachable (is mooncake_master running there?)")
        client = store_mod.MooncakeDistributedStore()
        rc = client.setup(local_hostname, metadata_server, segment_bytes, local_buffer_bytes,
                          protocol, rdma_devices, master_addr)
        if rc != 0:
            raise StoreUnreachable(f"remote_store: Mooncake setup against master "
                                   f"{master_addr} failed with code {rc}")
        self._client = client
        # Staging for batches the caller's memory cannot serve directly: [max_batch, 2, Hkv, B, d]
        self._staging = torch.empty((max_batch_blocks, *self.block_shape), dtype=dtype)
        self.register_memory(self._staging)

    def register_memory(self, tensor: torch.Tensor) -> None:
        """Registers a long-lived contiguous CPU tensor, so batches that live in it move
        without the staging copy. The caller keeps it alive until close()."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register_memory needs a contiguous CPU tensor")
        start = tensor.data_ptr()
        size = tensor.numel() * tensor.element_size()
        rc = self._live().register_buffer(start, size)
        if rc != 0:
            raise RemoteStoreError(f"Mooncake register_buffer of {size} bytes failed with code "
                                   f"{rc} (overlapping an already registered region?)")
        self._regions.append((start, start + size))

    def _live(self):  # noqa: ANN202 - the pybind class has no importable type
        if self._client is None:
            raise RemoteStoreError("the Mooncake store is closed")
        return self._client

    def _mkey(self, key: BlockKey) -> str:
        return f"{self.key_prefix}/{key}"

    def _direct_ptrs(self, blocks: torch.Tensor) -> list[int] | None:
        """Per-block addresses when every block of `blocks` is contiguous registered memory."""
        if blocks.device.type != "cpu" or not blocks[0].is_contiguous():
            return None
        step = blocks.stride(0) * blocks.element_size()
        ptrs = [blocks.data_ptr() + i * step for i in range(blocks.shape[0])]
        lo, hi = min(ptrs), max(ptrs) + self.block_bytes
        if step < self.block_bytes and blocks.shape[0] > 1:
            return None  # overlapping blocks (a broadcast view)
        return ptrs if any(s <= lo and hi <= e for s, e in self._regions) else None

    def _retrying(self, op: str, keys: Sequence[BlockKey | str],
                  call: Callable[[list[int]], list[int]], ok: Callable[[int], bool],
                  deadline: float) -> None:
        """Runs `call` on the indices still failing until all are ok; retries transient codes."""
        pending = list(range(len(keys)))
        for attempt in range(self.retries + 1):
            codes = call(pending)
            failed = [(i, c) for i, c in zip(pending, codes, strict=True) if not ok(c)]
            if not failed:
                return
            fatal = [(i, c) for i, c in failed if c not in TRANSIENT_CODES]
            out_of_time = attempt == self.retries or time.monotonic() >= deadline
            if fatal or out_of_time:
                bad = fatal or failed
                why = "" if fatal else f" after {attempt + 1} attempts (still transient)"
                bad_keys = [keys[i] for i, _ in bad]
                bad_codes = [c for _, c in bad]
                text = (f"Mooncake {op} failed{why} for {len(bad)} block(s): "
                        f"{describe_keys(bad_keys, bad_codes)}")
                if set(bad_codes) & FULL_CODES:  # no room: what the store's segments lend
                    raise StoreFull(f"remote store is full (its capacity is the memory its "
                                    f"clients and storage nodes lend): {text}", bad_keys,
                                    bad_codes)
                raise RemoteStoreError(text, bad_keys, bad_codes)
            pending = [i for i, _ in failed]
            time.sleep(max(0.0, min(0.05 * 2 ** attempt, deadline - time.monotonic())))

    def _batches(self, n: int) -> Iterable[tuple[int, int]]:
        step = self._staging.shape[0]
        return ((i, min(i + step, n)) for i in range(0, n, step))

    def _put(self, keys: list[BlockKey], blocks: torch.Tensor) -> None:
        client, size = self._live(), self.block_bytes
        deadline = time.monotonic() + self.deadline_s
        with self._lock:
            direct = self._direct_ptrs(blocks)
            for a, b in ([(0, len(keys))] if direct else self._batches(len(keys))):
                if direct:
                    ptrs = direct
                else:
                    self._staging[: b - a].copy_(blocks[a:b])
                    ptrs = self._direct_ptrs(self._staging[: b - a])
                mkeys = [self._mkey(k) for k in keys[a:b]]
                # upsert, not put: Mooncake's put of an existing key returns 0 and keeps the old
                # value; upsert gives the overwrite semantics of the interface.
                self._retrying("put", keys[a:b], lambda idx, mk=mkeys, p=ptrs: (
                    client.batch_upsert_from([mk[i] for i in idx], [p[i] for i in idx],
                                             [size] * len(idx))), lambda c: c == 0, deadline)

    def _get(self, keys: list[BlockKey], out: torch.Tensor) -> None:
        client, size = self._live(), self.block_bytes
        deadline = time.monotonic() + self.deadline_s
        with self._lock:
            direct = self._direct_ptrs(out)
            for a, b in ([(0, len(keys))] if direct else self._batches(len(keys))):
                ptrs = direct or self._direct_ptrs(self._staging[: b - a])
                mkeys = [self._mkey(k) for k in keys[a:b]]
                # batch_get_into returns the bytes read per key, or a negative error code.
                self._retrying("get", keys[a:b], lambda idx, mk=mkeys, p=ptrs: (
                    client.batch_get_into([mk[i] for i in idx], [p[i] for i in idx],
                                          [size] * len(idx))), lambda c: c == size, deadline)
                if not direct:
                    out[a:b].copy_(self._staging[: b - a])

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        keys = list(keys)
        if not keys:
            return []
        client = self._live()
        found: dict[int, bool] = {}

        def probe(idx: list[int]) -> list[int]:
            codes = client.batch_is_exist([self._mkey(keys[i]) for i in idx])
            found.update((i, c == 1) for i, c in zip(idx, codes, strict=True) if c in (0, 1))
            return [0 if c in (0, 1) else (-900 if c == -1 else c) for c in codes]

        self._retrying("contains", keys, probe, lambda c: c == 0,
                       time.monotonic() + self.deadline_s)
        return [found[i] for i in range(len(keys))]

    def remove(self, namespace: str) -> int:
        if not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must match {_NAMESPACE.pattern}")
        client = self._live()
        # ECMAScript regex on the master; only '.' and '+' of the allowed characters are special.
        pattern = "^" + re.sub(r"([.+])", r"\\\1", f"{self.key_prefix}/{namespace}/")
        removed: list[int] = []

        def call(idx: list[int]) -> list[int]:
            # force: a recent read holds a lease (default 10 s) that blocks a plain remove.
            n = client.remove_by_regex(pattern, True)
            removed.append(n)
            return [0 if n >= 0 else n]

        self._retrying("remove", [f"{namespace}/*"], call, lambda c: c == 0,
                       time.monotonic() + self.deadline_s)
        return removed[-1]

    def close(self) -> None:
        if self._client is None:
            return
        with self._lock:
            for start, _ in self._regions:
                self._client.unregister_buffer(start)
            self._regions.clear()
            self._client.close()
            self._client = None
