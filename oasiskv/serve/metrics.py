"""`/metrics`: Prometheus metrics named `oasiskv:...` as vLLM names its `vllm:...`, in a
registry of the server's own (several servers can live in one process, e.g. in tests).

Written from the engine loop's thread only: per-request latencies as outputs arrive, and the
engine's gauges and counters after every step (`update`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from oasiskv.engine.stats import device_memory
from oasiskv.outputs import RequestOutput
from oasiskv.sequence import Sequence

P = "oasiskv:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# sparse counters (kv.counters.SparseCounters) exposed as counters: field -> (name, help)
SPARSE_COUNTERS = {
    "predicted": ("sparse_blocks_predicted", "block-heads the sparse predictor chose"),
    "hits": ("sparse_block_hits", "... of them already resident in the device working set"),
    "admitted": ("sparse_blocks_admitted", "block-heads copied into device working sets"),
    "h2d_bytes": ("sparse_h2d_bytes", "bytes copied host -> device (fetches, active blocks)"),
    "remote_bytes": ("sparse_store_to_host_bytes", "bytes read remote store -> host caches"),
    "handoff_bytes": ("sparse_handoff_bytes", "decode worker: bytes of the hand-overs it admitted "
                      "(kept prompt blocks or slab read from the store, and the rest)"),
    "remote_put_bytes": ("sparse_host_to_store_bytes", "complete prompt blocks put host -> "
                         "remote store"),
    "stall_s": ("sparse_prefetch_stall_seconds", "foreground time spent waiting for prefetch"),
}


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.running = Gauge(P + "num_requests_running", "requests in the running batch",
                             registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "requests waiting to run (queued or "
                             "preempted)", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "a finished request's mean "
                              "time per output token after the first", buckets=TOKEN_BUCKETS,
                              registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "time between a request's "
                             "successive outputs", buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "arrival to finish (stop or "
                             "length)", buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens of requests that "
                                     "produced a token", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "tokens generated",
                                         registry=r)
        self.finished = Counter(P + "request_finished", "requests finished, by reason",
                                ["finished_reason"], registry=r)
        self.preemptions = Counter(P + "num_preemptions", "requests preempted (KV freed, "
                                   "recomputed later)", registry=r)
        self.kv_used = Gauge(P + "kv_device_bytes_used", "device KV bytes running requests hold "
                             "(sparse: slabs and block summaries)", registry=r)
        self.kv_budget = Gauge(P + "kv_device_bytes_budget", "device_kv_budget", registry=r)
        self.host_used = Gauge(P + "kv_host_bytes_used", "sparse: host tier bytes held",
                               registry=r)
        self.host_budget = Gauge(P + "kv_host_bytes_budget", "sparse: host tier bytes",
                                 registry=r)
        self.hit_rate = Gauge(P + "sparse_hit_rate", "sparse: share of the last step's "
                              "predicted block-heads already resident", registry=r)
        self.sparse = {k: Counter(P + name, text, registry=r)
                       for k, (name, text) in SPARSE_COUNTERS.items()}
        self.prefix_reused = Counter(P + "prefix_reused_tokens", "prompt tokens read from the "
                                     "store's prefix cache instead of computed", registry=r)
        self.prefix_cache = Gauge(P + "prefix_cache_bytes", "remote store bytes this engine's "
                                  "prefix-cache entries take", registry=r)
        self.prefix_evictions = Counter(P + "prefix_cache_evictions", "prefix-cache entries "
                                        "this engine removed to make room", registry=r)
        self._seen: dict[str, tuple[int, float]] = {}  # request -> (tokens counted, last time)
        self._last: dict[str, float] = {}  # engine counter -> value already counted

    def on_output(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        seen = self._seen.get(out.request_id)
        if seen is None and m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            seen = (0, now)
        if seen is not None:
            new = len(out.token_ids) - seen[0]
            if new > 0:
                if seen[0] > 0:
                    self.itl.observe(now - seen[1])
                self.generation_tokens.inc(new)
                seen = (len(out.token_ids), now)
            self._seen[out.request_id] = seen
        if out.finished:
            self._seen.pop(out.request_id, None)
            self.finished.labels(out.finish_reason).inc()
            if out.finish_reason in ("stop", "length"):
                self.e2e.observe(m.finish_time - m.arrival_time)
                if m.tpot is not None:
                    self.tpot.observe(m.tpot)

    def on_abort(self, seq: Sequence) -> None:
        self._seen.pop(seq.request_id, None)
        self.finished.labels("abort").inc()

    def set_queues(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def update(self, engine) -> None:
        """The engine's memory gauges and the increments of its cumulative counters."""
        mem = device_memory(engine)
        self.kv_used.set(mem["device_bytes_used"])
        self.kv_budget.set(mem["device_kv_budget"])
        self._count(self.preemptions, "preemptions", engine.scheduler.num_preemptions)
        if engine.sparse is None:
            return
        self.host_used.set(engine.host_pool.num_used * engine.bytes_per_block)
        self.host_budget.set(engine.host_pool.num_blocks * engine.bytes_per_block)
        for field, counter in self.sparse.items():
            self._count(counter, field, getattr(engine.sparse.counters, field))
        last = engine.sparse.last_step
        if last.predicted:
            self.hit_rate.set(last.hits / last.predicted)
        if engine.remote is not None:
            prefix = engine.remote.prefix
            self._count(self.prefix_reused, "prefix_reused_tokens",
                        engine.counters["prefix_reused_tokens"])
            self.prefix_cache.set(prefix.bytes_held)
            self._count(self.prefix_evictions, "prefix_cache_evictions", prefix.evictions)

    def _count(self, counter: Counter, key: str, total: float) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total
