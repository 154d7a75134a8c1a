"""The remote store's errors, and the Mooncake Store error codes they carry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oasiskv.store.remote_store import BlockKey

# Mooncake Store error codes (mooncake-store/include/types.h) that name what went wrong.
MOONCAKE_CODES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (no room in the mounted segments)",
    -400: "INVALID_KEY", -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
}
# Worth retrying: a holder that died but is not yet expired (-800 until the master's client_ttl
# runs out, then -704, which is final), a replica mid-write, or a master that is unreachable
# right now (-900/-901: each such call blocks ~4.5 s in Mooncake's reconnect before it returns).
TRANSIENT_CODES = frozenset({-703, -707, -800, -900, -901})
# A put that found no room: the master could not allocate the object in any mounted segment.
FULL_CODES = frozenset({-200})


def mooncake_code_name(code: int) -> str:
    return f"{code} {MOONCAKE_CODES.get(code, 'error')}"


def describe_keys(keys: Sequence[BlockKey | str], codes: Sequence[int | None],
                  limit: int = 8) -> str:
    parts = [str(k) if c is None else f"{k} ({mooncake_code_name(c)})"
             for k, c in zip(keys[:limit], codes[:limit], strict=False)]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(parts) + more


class RemoteStoreError(RuntimeError):
    """A block could not be stored or read. `keys` are the blocks that failed, `codes` their
    backend error codes (None where there is none, e.g. a missing key in InProcessStore)."""

    def __init__(self, message: str, keys: Sequence[BlockKey | str] = (),
                 codes: Sequence[int | None] = ()) -> None:
        super().__init__(message)
        self.keys = list(keys)
        self.codes = list(codes)


class StoreUnreachable(RemoteStoreError, ValueError):
    """The store cannot be opened at start (its master does not answer): a ValueError, as a
    bad `remote_store` address is, raised where the engine is built."""


class StoreFull(RemoteStoreError):
    """A put found no room in the store: its capacity (InProcessStore's `capacity_bytes`;
    Mooncake's, the memory its clients and storage nodes lend) is taken. Nothing of the put
    is kept. Worth retrying once other requests have left the store."""
