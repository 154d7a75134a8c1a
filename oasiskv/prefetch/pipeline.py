"""Per-layer chains of prefetch stages (paper §3.3): predict -> select -> remote fetch -> local
fetch for (layer, step), submitted after the layer's attention of step t, consumed before the
same layer's attention of step t+1. The foreground waits only for the layer it is about to run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from oasiskv.prefetch.executor import Executor, Handle, PrefetchError
from oasiskv.prefetch.trace import Tracer


class PrefetchPipeline:
    def __init__(self, executor: Executor, tracer: Tracer | None = None) -> None:
        self.executor = executor
        self.tracer = executor.tracer = tracer
        self._last: dict[int, Handle] = {}  # layer -> last stage of its pending chain
        self._owners: dict[int, list] = {}  # layer -> requests its pending jobs touch
        self.stall_s = 0.0  # foreground time spent waiting, since the last take_stall()

    def submit(self, layers: int | list[int], label: str,
               stages: list[tuple[str, Callable[[], None]]], owners: list) -> None:
        """Chains `stages` after whatever any of `layers` still has pending (a job of several
        layers waits for each of their earlier jobs); it is what each of them waits for next."""
        layers = [layers] if isinstance(layers, int) else layers
        after = list({id(h): h for h in map(self._last.get, layers) if h is not None}.values())
        name = f"L{layers[0]}" if len(layers) == 1 else f"L{layers[0]}-{layers[-1]}"
        for stage, fn in stages:
            after = [self.executor.submit(stage, fn, after, f"{name} {label}")]
        for layer in layers:
            self._last[layer] = after[0]
            self._owners.setdefault(layer, []).extend(owners)

    def wait(self, layer: int) -> None:
        """Blocks until the layer's pending chain is done; re-raises its failure with the
        requests it touched (`error.owners`)."""
        handle = self._last.pop(layer, None)
        owners = self._owners.pop(layer, [])
        if handle is None:
            return
        start = time.perf_counter()
        try:
            handle.wait()
        except PrefetchError as e:
            e.owners = owners
            raise
        finally:
            end = time.perf_counter()
            self.stall_s += end - start
            if self.tracer is not None and end - start > 1e-5:
                self.tracer.span("foreground", f"wait L{layer}", start, end)

    def pending_owners(self) -> list:
        """The requests that jobs not yet waited for touch (a job may still be running)."""
        return [owner for owners in self._owners.values() for owner in owners]

    def touches(self, owner: object) -> bool:
        """Whether a job not yet waited for may still read or write `owner`'s blocks."""
        return any(o is owner for o in self.pending_owners())

    def drain(self) -> list[PrefetchError]:
        """Waits for every layer; returns the failures instead of raising."""
        errors = []
        for layer in list(self._last):
            try:
                self.wait(layer)
            except PrefetchError as e:
                errors.append(e)
        return errors

    def take_stall(self) -> float:
        stall, self.stall_s = self.stall_s, 0.0
        return stall

    def close(self) -> None:
        self.drain()
        self.executor.close()
