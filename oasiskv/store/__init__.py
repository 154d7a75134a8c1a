"""The remote KV store: whole KV blocks keyed by (namespace, layer, block), in-process or in
Mooncake Store, and the helpers that run Mooncake locally (a master, a storage node). A single
engine with `f_host` < 1 uses it as much as prefill/decode disaggregation does."""

from oasiskv.store.mooncake_store import MooncakeStore
from oasiskv.store.remote_store import (
    BlockKey,
    InProcessStore,
    RemoteStore,
    RemoteStoreError,
    StoreFull,
)

__all__ = ["BlockKey", "InProcessStore", "MooncakeStore", "RemoteStore", "RemoteStoreError",
           "StoreFull"]
