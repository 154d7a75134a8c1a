"""Mooncake Store as the remote KV tier (the multi-machine backend of `remote_store.RemoteStore`).

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
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from oasiskv.store.errors import (
    FULL_CODES,
    TRANSIENT_CODES,
    RemoteStoreError,
    StoreFull,
    StoreUnreachable,
    describe_keys,
)
from oasiskv.store.remote_store import NAMESPACE, BlockKey, RemoteStore


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
        if not NAMESPACE.fullmatch(key_prefix):
            raise ValueError(f"key_prefix {key_prefix!r} must match {NAMESPACE.pattern}")
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
        if not NAMESPACE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must match {NAMESPACE.pattern}")
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
