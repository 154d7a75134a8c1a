"""The remote KV tier: whole KV blocks keyed by (namespace, layer, block), moved in batches.

The remote tier holds a request's complete prompt KV outside the decode host (DESIGN.md s5), so
the decode host can keep a bounded cache and fetch misses again instead of approximating.
One block is `[2, Hkv, B, d]` (K then V, all KV heads, B token positions) of one fixed dtype;
batches are `[n, 2, Hkv, B, d]`. A namespace is a request id (private blocks) or a prefix hash
(complete prompt blocks shared by requests with the same prefix).

Backends: `InProcessStore` (a dict of CPU tensors: the single-node default) and `MooncakeStore`
(`store/mooncake_store.py`, a Mooncake Store client: multi-machine). Every store counts the
bytes it moved (`bytes_put`, `bytes_got`), the figures the benchmarks print.

A full store refuses a put with `StoreFull` (InProcessStore past its optional `capacity_bytes`;
Mooncake's code -200 NO_AVAILABLE_HANDLE, no room in any mounted segment), and the put's
caller removes what of it arrived (`kv/remote_tier.py`), so no prompt is half-stored.
"""

from __future__ import annotations

import abc
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from oasiskv.store.errors import (
    RemoteStoreError,
    StoreFull,
    describe_keys,
)

NAMESPACE = re.compile(r"[A-Za-z0-9_.:@=+-]+")
_KEY = re.compile(r"(?P<ns>[A-Za-z0-9_.:@=+-]+)/L(?P<layer>\d+)/B(?P<block>\d+)")


@dataclass(frozen=True, order=True)
class BlockKey:
    """One block of one layer of a namespace (request id or prefix hash)."""

    namespace: str
    layer: int
    block: int

    def __post_init__(self) -> None:
        if not NAMESPACE.fullmatch(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} must match {NAMESPACE.pattern} "
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
