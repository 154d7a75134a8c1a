"""Disaggregated serving: the remote KV tier (in-process or Mooncake Store)."""

from oasiskv.disagg.remote_store import (
    BlockKey,
    InProcessStore,
    MooncakeStore,
    RemoteStore,
    RemoteStoreError,
)

__all__ = ["BlockKey", "InProcessStore", "MooncakeStore", "RemoteStore", "RemoteStoreError"]
