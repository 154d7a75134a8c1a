"""A Mooncake storage node: a process that only lends memory to the store.

The engines that put blocks then lend nothing (`remote_lend=0`), so every block they put lands
in this process's segment and every read of it crosses Mooncake's transport, as it would from
another host. `bench pipeline --remote-store mooncake` runs one beside its master.

`python -m oasiskv.store.store_node MASTER BYTES` mounts BYTES of memory, prints "ready", and
holds it until its stdin closes (the parent's `StoreNode.close`, or the parent's death).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile

import torch

from oasiskv.store.mooncake_store import MooncakeStore


class StoreNode:
    """The node as a child process of this one (started from the current network namespace)."""

    def __init__(self, master_addr: str, lend_bytes: int, timeout_s: float = 60.0) -> None:
        self.log = tempfile.TemporaryFile()  # Mooncake's log lines, for the error below
        self.process = subprocess.Popen(
            [sys.executable, "-m", "oasiskv.store.store_node", master_addr, str(lend_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""  # "" also when it died first
        if line.strip() != "ready":
            self.process.kill()
            self.process.wait()
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace").strip().splitlines()[-5:]
            self.close()
            raise RuntimeError(f"Mooncake storage node did not start against master "
                               f"{master_addr} (exit code {self.process.returncode}): "
                               + " | ".join(tail))

    def close(self) -> None:
        self.process.stdin.close()  # the node's cue to unmount and exit
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self.log.close()

    def __enter__(self) -> StoreNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str]) -> None:
    master_addr, lend_bytes = argv[0], int(argv[1])
    env = os.environ  # where peers reach this node, as the engines' stores (remote_tier)
    # the block shape is the readers' business; this node only mounts its segment
    store = MooncakeStore((2, 1, 1, 1), torch.float32, master_addr, segment_bytes=lend_bytes,
                          max_batch_blocks=1,
                          local_hostname=env.get("OASISKV_MOONCAKE_HOSTNAME", "127.0.0.1"),
                          protocol=env.get("OASISKV_MOONCAKE_PROTOCOL", "tcp"),
                          rdma_devices=env.get("OASISKV_MOONCAKE_RDMA_DEVICES", ""))
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes it
    store.close()


if __name__ == "__main__":
    main(sys.argv[1:])
