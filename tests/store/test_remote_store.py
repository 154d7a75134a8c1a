"""The remote KV tier: both backends move whole blocks bit-exactly, count bytes, name missing
keys, remove by namespace, and fail (never hang) when a Mooncake holder or master dies.

Mooncake tests start a real `mooncake_master` (no mocks) inside a private network namespace
when the kernel allows one (Mooncake clients listen on all interfaces); they are skipped only
when the wheel is not installed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import needs_mooncake

from oasiskv.store import BlockKey, InProcessStore, MooncakeStore, RemoteStore, RemoteStoreError
from oasiskv.store.mooncake import free_port, port_open, private_network, start_master

BLOCK = (2, 2, 4, 8)  # [2 (K, V), Hkv, B, d]
DTYPE = torch.bfloat16
BLOCK_BYTES = 2 * 2 * 4 * 8 * 2


def random_blocks(n: int, seed: int = 0) -> torch.Tensor:
    """[n, 2, Hkv, B, d] random blocks, the same in every process for a seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *BLOCK), generator=g).to(DTYPE)


def keys_for(namespace: str, n: int, layers: int = 2) -> list[BlockKey]:
    return [BlockKey(namespace, i % layers, i // layers) for i in range(n)]


def mooncake_store(address: str, **kwargs) -> MooncakeStore:
    kwargs = {"segment_bytes": 32 << 20, "max_batch_blocks": 4, "deadline_s": 5.0,
              "key_prefix": f"t{uuid.uuid4().hex[:8]}", **kwargs}
    return MooncakeStore(BLOCK, DTYPE, address, **kwargs)


@pytest.fixture(params=["inprocess", pytest.param("mooncake", marks=needs_mooncake)])
def store(request):
    if request.param == "inprocess":
        s: RemoteStore = InProcessStore(BLOCK, DTYPE)
    else:
        # max_batch_blocks=4: the batches below span several staging rounds.
        s = mooncake_store(request.getfixturevalue("master").address)
    yield s
    s.close()


def test_block_key_string_form_is_stable():
    key = BlockKey("req-7", 3, 12)
    assert str(key) == "req-7/L3/B12"
    assert BlockKey.parse(str(key)) == key
    assert BlockKey.parse("ab12.cd:0/L0/B0") == BlockKey("ab12.cd:0", 0, 0)
    for bad in ("a/b", "", "x y"):
        with pytest.raises(ValueError):
            BlockKey(bad, 0, 0)
    with pytest.raises(ValueError):
        BlockKey.parse("req/L1")


def test_round_trip_is_bit_exact_and_counted(store):
    keys = keys_for("req-1", 10)
    blocks = random_blocks(10)
    store.put_blocks(keys[:3], blocks[:3])  # two batches of puts
    store.put_blocks(keys[3:], blocks[3:])
    assert store.bytes_put == 10 * BLOCK_BYTES == 10 * store.block_bytes
    out = store.get_blocks(keys)
    assert torch.equal(out, blocks)
    # a subset in another order, into a caller's tensor
    order = [7, 0, 9, 4, 5]
    dst = torch.zeros((len(order), *BLOCK), dtype=DTYPE)
    assert store.get_blocks([keys[i] for i in order], dst) is dst
    assert torch.equal(dst, blocks[order])
    assert store.bytes_got == 15 * BLOCK_BYTES
    assert store.bytes_put == 10 * BLOCK_BYTES


def test_missing_key_names_the_key(store):
    keys = keys_for("req-2", 3)
    store.put_blocks(keys, random_blocks(3))
    missing = BlockKey("req-2", 5, 99)
    with pytest.raises(RemoteStoreError, match="req-2/L5/B99") as err:
        store.get_blocks([keys[0], missing, keys[2]])
    assert err.value.keys == [missing]
    if isinstance(store, MooncakeStore):
        assert err.value.codes == [-704] and "-704" in str(err.value)
    assert store.bytes_got == 0


def test_contains_overwrite_and_remove_by_namespace(store):
    a, b = keys_for("req-a", 4), keys_for("ab12ff", 4)
    store.put_blocks(a, random_blocks(4, seed=1))
    store.put_blocks(b, random_blocks(4, seed=2))
    store.get_blocks(a)  # a read takes a Mooncake lease; remove must still work
    store.put_blocks(a[:1], random_blocks(1, seed=3))  # put overwrites
    assert torch.equal(store.get_blocks(a[:1]), random_blocks(1, seed=3))
    assert store.contains([a[0], BlockKey("req-a", 9, 9), b[3]]) == [True, False, True]
    assert b[0] in store
    assert store.remove("req-a") == 4
    assert store.contains(a) == [False] * 4
    assert store.remove("req-a") == 0
    with pytest.raises(RemoteStoreError, match="req-a/L0/B0"):
        store.get_blocks(a[:1])
    assert torch.equal(store.get_blocks(b), random_blocks(4, seed=2))


def test_private_network_hides_listeners():
    """What the Mooncake tests rely on: a socket listening on all interfaces inside the private
    namespace is not reachable from the machine's own network, and we get back out."""
    home = os.stat("/proc/thread-self/ns/net").st_ino
    with private_network() as private:
        if not private:
            pytest.skip("the kernel refused a private network namespace (unshare CLONE_NEWNET)")
        assert os.stat("/proc/thread-self/ns/net").st_ino != home
        server = socket.create_server(("0.0.0.0", 0))
        port = server.getsockname()[1]
        assert port_open("127.0.0.1", port)
    try:
        assert os.stat("/proc/thread-self/ns/net").st_ino == home
        assert not port_open("127.0.0.1", port)
    finally:
        server.close()


def test_shape_and_dtype_are_checked():
    store = InProcessStore(BLOCK, DTYPE)
    with pytest.raises(ValueError, match="must be"):
        store.put_blocks(keys_for("r", 2), random_blocks(2).float())
    with pytest.raises(ValueError, match="must be"):
        store.put_blocks(keys_for("r", 3), random_blocks(2))
    with pytest.raises(ValueError, match="duplicate"):
        store.put_blocks([BlockKey("r", 0, 0)] * 2, random_blocks(2))
    with pytest.raises(ValueError, match="block_shape"):
        InProcessStore((3, 2, 4, 8), DTYPE)
    assert store.bytes_put == 0


@needs_mooncake
def test_mooncake_registered_memory_skips_staging(master):
    with mooncake_store(master.address) as store:
        pool = torch.zeros((12, *BLOCK), dtype=DTYPE)  # a host block cache
        store.register_memory(pool)
        keys = keys_for("req-z", 6)
        pool[6:12] = random_blocks(6, seed=4)
        store.put_blocks(keys, pool[6:12])  # straight from the pool, 6 > max_batch_blocks
        store.get_blocks(keys[::-1], pool[0:6])  # straight into the pool
        assert torch.equal(pool[0:6], random_blocks(6, seed=4).flip(0))
        assert store.bytes_got == store.bytes_put == 6 * BLOCK_BYTES


@needs_mooncake
def test_mooncake_unreachable_master_fails_fast(master):
    t0 = time.monotonic()
    with pytest.raises(RemoteStoreError, match="not reachable"):
        mooncake_store(f"127.0.0.1:{free_port()}")  # Mooncake itself would retry for ~90 s
    assert time.monotonic() - t0 < 10
    with pytest.raises(RuntimeError, match="port is taken"):
        start_master(master.port)


HOLDER = """
import sys, time, pathlib, torch
from oasiskv.store import MooncakeStore, BlockKey
addr, prefix, ready = sys.argv[1:4]
g = torch.Generator().manual_seed(5)
blocks = torch.randn((6, 2, 2, 4, 8), generator=g).to(torch.bfloat16)
store = MooncakeStore((2, 2, 4, 8), torch.bfloat16, addr, key_prefix=prefix,
                      segment_bytes=32 << 20)
store.put_blocks([BlockKey("req-h", i % 2, i // 2) for i in range(6)], blocks)
pathlib.Path(ready).write_text("ready")
time.sleep(300)
"""


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"holder exited with {proc.returncode}"
        assert time.monotonic() < deadline, "holder did not get ready"
        time.sleep(0.05)


@needs_mooncake
def test_mooncake_dead_holder_fails_within_deadline(mooncake_net, tmp_path):
    """The process whose memory holds the blocks dies: reads fail with a clear error
    (-800 while the master still lists it, -704 after client_ttl) instead of hanging."""
    prefix, ready = f"h{uuid.uuid4().hex[:8]}", tmp_path / "ready"
    with start_master(client_ttl_s=2) as own_master, open(tmp_path / "holder.log", "wb") as log:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, own_master.address, prefix,
                                   str(ready)], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(ready, holder, 30)
            # segment_bytes=0: the reader lends no memory, so every block lives in the holder
            with mooncake_store(own_master.address, key_prefix=prefix, segment_bytes=0,
                                deadline_s=4.0) as reader:
                keys = keys_for("req-h", 6)
                assert torch.equal(reader.get_blocks(keys), random_blocks(6, seed=5))
                holder.kill()
                holder.wait()
                t0 = time.monotonic()
                with pytest.raises(RemoteStoreError, match="req-h/L") as err:
                    reader.get_blocks(keys)
                assert time.monotonic() - t0 < 30
                assert set(err.value.codes) <= {-800, -704}, err.value
                assert reader.bytes_got == 6 * BLOCK_BYTES
                time.sleep(2.5)  # past client_ttl the master has dropped the holder's blocks
                assert reader.contains(keys) == [False] * 6
        finally:
            holder.kill()
            holder.wait()


@needs_mooncake
def test_mooncake_dead_master_fails_within_deadline_and_recovers(mooncake_net):
    """The master dies: reads fail with RPC_FAIL within the deadline. A master restarted on the
    same port knows no objects (-704), and puts work again once the client re-mounts its
    segment (-200 until its next heartbeat)."""
    first = start_master()
    own_master = first
    store = mooncake_store(own_master.address, deadline_s=2.0)
    try:
        keys = keys_for("req-m", 3)
        store.put_blocks(keys, random_blocks(3))
        own_master.kill()
        t0 = time.monotonic()
        with pytest.raises(RemoteStoreError, match="req-m/L") as err:
            store.get_blocks(keys)
        assert time.monotonic() - t0 < 30
        assert set(err.value.codes) <= {-900, -901}, err.value
        own_master = start_master(first.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                store.put_blocks(keys[:1], random_blocks(1, seed=6))
                break
            except RemoteStoreError as e:
                assert e.codes == [-200] and time.monotonic() < deadline, e
                time.sleep(0.2)
        assert torch.equal(store.get_blocks(keys[:1]), random_blocks(1, seed=6))
        assert store.contains(keys) == [True, False, False]
    finally:
        store.close()  # ~2 s; with the master still dead ~12 s (teardown RPCs time out)
        own_master.stop()
        first.stop()
