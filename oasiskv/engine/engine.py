"""The engine: admits requests, steps the scheduler and the model, finishes requests."""

from __future__ import annotations

import itertools
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

from oasiskv.config import CacheConfig, EngineConfig, ModelConfig, parse_bytes
from oasiskv.disagg.handoff import TRANSFERS, Handoff
from oasiskv.engine import remote_steps
from oasiskv.engine.failures import StepFailures
from oasiskv.engine.invariants import check_invariants
from oasiskv.engine.runner import ModelRunner, allocate_kv, is_decode
from oasiskv.engine.scheduler import ScheduledBatch, Scheduler
from oasiskv.engine.sequence import Sequence
from oasiskv.kv.blocks import BlockPool, KVAllocator
from oasiskv.kv.dense_layers import allocate_dense_kv, check_dense_layers, sparse_layers
from oasiskv.kv.device_budget import (
    dense_layer_bytes,
    device_memory,
    device_tensors,
    key_copy_bytes,
    split_dense,
    split_sparse,
    summary_bytes,
)
from oasiskv.kv.remote_tier import RemoteTier, open_store
from oasiskv.kv.rerank import warm_up_rerank
from oasiskv.kv.residency import SparseKV
from oasiskv.kv.scorers import warm_up_scores
from oasiskv.kv.summaries import warm_up_key_copy
from oasiskv.layers.linear import pack_linears
from oasiskv.layers.sampler import sample, verify_draft
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.models.loader import load_checkpoint
from oasiskv.models.registry import resolve_model
from oasiskv.outputs import RequestOutput
from oasiskv.prefetch.executor import make_executor
from oasiskv.prefetch.pipeline import PrefetchPipeline
from oasiskv.prefetch.trace import Tracer
from oasiskv.sampling_params import SamplingParams
from oasiskv.spec.drafters import chained_draft, make_drafter, sampling_weights

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, share_weights: LLMEngine | None = None) -> None:
        """`share_weights`: an engine of the same model, dtype and device whose weight tensors
        this one uses instead of loading its own copy (engines compared side by side in one
        process: the weights are read-only, each engine keeps its own KV and modules)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        dtype = config.torch_dtype
        if share_weights is None:
            ckpt = load_checkpoint(resolve_model(config.model), dtype=dtype)
            mc, self.tokenizer = ModelConfig.from_hf(ckpt.hf_config), ckpt.tokenizer
        else:
            other = share_weights.config
            if (other.model, other.torch_dtype, share_weights.device) != (config.model, dtype,
                                                                         self.device):
                raise ValueError(f"share_weights: that engine runs {other.model} "
                                 f"({other.dtype}, {other.device}), this one {config.model} "
                                 f"({config.dtype}, {config.device})")
            mc, self.tokenizer = share_weights.model_config, share_weights.tokenizer
        self.model_config = mc
        with torch.device("meta"):  # no time spent on random init of weights we overwrite
            model = LlamaForCausalLM(mc)
        model = model.to_empty(device=self.device).to(dtype)
        model.model.rotary.build()  # its tables are computed, not loaded
        if share_weights is None:
            model.load_weights(ckpt.state_dict)
        else:  # the same Parameter objects (tied embeddings stay tied)
            model.load_state_dict(share_weights.model.state_dict(keep_vars=True), assign=True)
        # CPU: linear weights also in oneDNN's layout (faster decode and prefill)
        pack_linears(model, share_weights.model if share_weights is not None else None)
        self.model = model.eval()

        self.max_model_len = config.scheduler.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context "
                             f"{mc.max_position_embeddings}")
        if mc.sliding_window and self.max_model_len > mc.sliding_window:
            log.warning("model uses a %d-token sliding window; capping max_model_len to it",
                        mc.sliding_window)
            self.max_model_len = mc.sliding_window
        self._build_kv(config.cache, mc, dtype)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        self.requests: dict[str, Sequence] = {}
        self.counters = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0,
                         "requests_added": 0, "requests_finished": 0, "requests_failed": 0,
                         "step_failures": 0, "drafts": 0, "drafts_right": 0, "spec_accepted": 0,
                         "prefix_reused_tokens": 0}
        self.host_cache_peak = 0  # remote store: most host blocks a finished request held
        lookahead = self.sparse is not None and self.sparse.predictor.uses_drafts
        self.speculative = config.spec.speculative == "accept"
        self.drafter = None
        if lookahead or self.speculative:
            self.drafter = make_drafter(
                config.spec.drafter, config.spec.draft_model, mc.vocab_size,
                target=model, dtype=config.dtype, device=config.device,
                device_kv_budget="1GiB")
            self.runner.aux_layers = self.drafter.feature_layers
        self.scheduler.extra_decode_slots = int(self.speculative)
        self.runner.keep_draft_kv = self.speculative
        self.step_log: deque[dict] = deque(maxlen=100_000)  # per-step figures, newest last
        # Called with (batch) after each successful forward; tests use it to inject faults.
        self.step_hooks: list[Callable[[ScheduledBatch], None]] = []

    def _build_kv(self, cache: CacheConfig, mc: ModelConfig, dtype: torch.dtype) -> None:
        """Device tensors (dense blocks, or sparse slabs and block summaries) that together
        take at most device_kv_budget bytes (`kv/device_budget.py`), and in sparse mode the
        host tier."""
        block = cache.block_size
        self.bytes_per_block = mc.kv_bytes_per_token(dtype) * block
        check_dense_layers(cache.dense_layers, mc)
        if cache.kv_mode == "sparse" and self.device.type != "cpu":
            raise ValueError("kv_mode=sparse runs on the CPU for now: its prefill reads the "
                             "host tier in place (the GPU path needs the prefetch executor)")
        if cache.kv_mode == "dense":
            self.device_split = split_dense(cache.device_kv_budget, self.bytes_per_block)
            device_kv = allocate_kv(mc, self.device_split.kv_blocks, block, dtype, self.device)
            self.pool = BlockPool(self.device_split.kv_blocks, block)
            self.kv = KVAllocator(self.pool)
            self.sparse = None
            self.runner = ModelRunner(self.model, device_kv, block)
        else:
            host_blocks = cache.host_kv_budget // self.bytes_per_block
            if host_blocks == 0:
                raise ValueError(f"host_kv_budget {cache.host_kv_budget} B is smaller than one "
                                 f"KV block ({self.bytes_per_block} B)")
            one_node = cache.remote_store == "none"
            summary_dtype = cache.summary_torch_dtype(dtype)
            n_dense = cache.dense_layers  # the slabs, summaries, key copy: the other layers'
            smc = sparse_layers(mc, n_dense)
            # Summary ids the host tier can use: one node, one per host block (its id); with a
            # remote store they outlive host blocks: enough for every request that host caches
            # at f_host could hold (a budget >= f_host * history).
            split = self.device_split = split_sparse(
                cache.device_kv_budget, smc.kv_bytes_per_token(dtype) * block,
                summary_bytes(smc, summary_dtype, cache.summary_splits)
                + (key_copy_bytes(smc, block, cache.key_copy_bits) if cache.key_copy else 0)
                + dense_layer_bytes(mc, n_dense, block, dtype),
                cache.slab_blocks, -(-self.max_model_len // block),
                host_blocks if one_node else math.ceil(host_blocks / cache.f_host))
            if one_node and split.summary_ids < host_blocks:
                log.info("host tier: %d of host_kv_budget's %d blocks, the most whose "
                         "summaries device_kv_budget holds beside the slabs",
                         split.summary_ids, host_blocks)
                host_blocks = split.summary_ids
            device_kv = allocate_kv(smc, split.kv_blocks, block, dtype, self.device)
            self.pool = BlockPool(split.kv_blocks, block)
            host_kv = allocate_kv(mc, host_blocks, block, dtype,
                                  pin=torch.cuda.is_available())
            self.host_pool = BlockPool(host_blocks, block)
            remote = self._build_remote(cache, mc, dtype, host_kv)
            self.kv = KVAllocator(self.pool, self.host_pool, slab_blocks=cache.slab_blocks,
                                  summaries=None if remote is None else
                                  BlockPool(split.summary_ids, block),
                                  summary_room=split.summary_room)
            summary = (smc.num_layers, split.summary_ids, mc.num_kv_heads, mc.head_dim)
            rows = (smc.num_layers, split.summary_ids * cache.summary_splits, *summary[2:])
            executor = make_executor(cache.prefetch, self.device)
            weakref.finalize(self, executor.close)  # no worker outlives the engine
            self.sparse = SparseKV(cache, device_kv, host_kv[n_dense:] if n_dense else host_kv,
                                   torch.empty(rows, dtype=summary_dtype, device=self.device),
                                   torch.empty(rows, dtype=summary_dtype, device=self.device),
                                   PrefetchPipeline(executor), remote=remote,
                                   scales=[a.scale for a in
                                           self.model.attention_layers()][n_dense:])
            if cache.key_copy:  # int4: two codes a byte
                bits = cache.key_copy_bits
                self.sparse.key_codes = torch.empty(
                    (*summary[:3], mc.head_dim, block * bits // 8), device=self.device,
                    dtype=torch.int8 if bits == 8 else torch.uint8)
                self.sparse.key_scales = torch.empty(summary[:3], device=self.device)
            dense_kv = allocate_dense_kv(mc, n_dense, split.summary_ids, block, dtype,
                                         self.device)
            self.runner = ModelRunner(self.model, device_kv, block, host_kv, self.sparse,
                                      dense_kv)
            t0 = time.perf_counter()
            warm_up_scores(self.sparse.kmin, cache.score_aggregation,
                           mc.num_heads // mc.num_kv_heads, cache.summary_splits)
            if cache.reranks:  # its second stage, over the keys it reads
                keys = (self.sparse.key_codes if cache.key_copy else
                        self.sparse.host_kv[:, 0].unflatten(2, (-1, block)).transpose(1, 2))
                warm_up_rerank(keys, mc.num_heads)
            if cache.key_copy:
                warm_up_key_copy(self.sparse.host_kv, block, cache.key_copy_bits)
            log.info("compiled the block scoring in %.1f s", time.perf_counter() - t0)
        if cache.prefault_kv:
            t0 = time.perf_counter()
            pools = device_tensors(self) + ([] if self.sparse is None else
                                            [self.runner.host_kv])
            for pool in pools:
                pool.zero_()
            log.info("prefaulted %.2f GiB of KV pools in %.1f s",
                     sum(p.numel() * p.element_size() for p in pools) / 2**30,
                     time.perf_counter() - t0)
        self.scheduler = Scheduler(self.config.scheduler, self.kv)

    def _build_remote(self, cache: CacheConfig, mc: ModelConfig, dtype: torch.dtype,
                      host_kv: torch.Tensor) -> RemoteTier | None:
        store = open_store(cache.remote_store,
                           (2, mc.num_kv_heads, cache.block_size, mc.head_dim), dtype,
                           parse_bytes(cache.remote_lend))
        if store is None:
            return None
        weakref.finalize(self, store.close)
        return RemoteTier(store, host_kv, cache.block_size, cache.f_host,
                          cache.top_k * mc.num_kv_heads)

    # ---- requests -------------------------------------------------------------------------

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None,
                      prefix_kv: torch.Tensor | None = None) -> Sequence:
        """Validates a request at the boundary; nothing is queued yet. `prefix_kv` (from
        `compute_prefix_kv` of an engine with the same model) spares prefilling a prefix."""
        params = params or SamplingParams()
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt is empty")  # before a tokenizer adds BOS to it
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, model context is "
                             f"{self.max_model_len} (it must leave room for one output token)")
        max_context = len(ids) + params.max_tokens
        if max_context > self.max_model_len:  # refused, not capped (vLLM's check and words)
            raise ValueError(f"max_tokens is too large: {params.max_tokens}. This model's "
                             f"maximum context length is {self.max_model_len} tokens and your "
                             f"request has {len(ids)} input tokens ({params.max_tokens} > "
                             f"{self.max_model_len} - {len(ids)})")
        problem = self.kv.fits_alone(max_context)
        if problem:
            raise ValueError(problem)
        request_id = request_id or str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        for what, tokens in (("forced tokens", params.forced_tokens),
                             ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in tokens
                   if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"{what} {bad[:5]} are outside the vocabulary "
                                 f"[0, {self.model_config.vocab_size})")
        if prefix_kv is not None:
            prefix_kv = self._check_prefix_kv(prefix_kv, len(ids))
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = Sequence(request_id, ids, len(ids), params, prompt=text, generator=gen,
                       max_context=max_context, prefix_kv=prefix_kv)
        if prefix_kv is not None:
            seq.num_computed_tokens = prefix_kv.shape[3]
        return seq

    def _check_prefix_kv(self, kv: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        mc = self.model_config
        want = (mc.num_layers, 2, mc.num_kv_heads, mc.head_dim)
        if kv.dim() != 5 or (*kv.shape[:3], kv.shape[4]) != want:
            raise ValueError(f"prefix_kv has shape {tuple(kv.shape)}; this model's is "
                             f"[{want[0]}, 2, {want[2]}, n, {want[3]}]")
        if not 0 < kv.shape[3] < num_prompt_tokens:
            raise ValueError(f"prefix_kv covers {kv.shape[3]} tokens; it must cover 1 to "
                             f"{num_prompt_tokens - 1} (the last prompt token is computed to "
                             "sample the first output)")
        return kv.to(self.runner.device_kv.dtype)

    @torch.inference_mode()
    def compute_prefix_kv(self, ids: list[int]) -> torch.Tensor:
        """Prefills `ids` outside the scheduler and returns their K/V [L, 2, Hkv, n, d]
        (dense attention, chunks of max_num_batched_tokens), for `add_request(prefix_kv=)`
        of this or another engine with the same model: prefill once, decode many ways."""
        seq = self.make_sequence(list(ids) + [0], SamplingParams(max_tokens=1))
        chunk = self.config.scheduler.max_num_batched_tokens
        try:
            for start in range(0, len(ids), chunk):
                n = min(chunk, len(ids) - start)
                self.kv.grow(seq, start + n)
                self.runner.run([(seq, n)], [])
                seq.num_computed_tokens += n
            return self.runner.read_kv(seq, len(ids))
        finally:
            self.kv.free(seq)

    def add_sequence(self, seq: Sequence) -> str:
        seq.metrics.num_prompt_tokens = seq.num_prompt_tokens
        remote = self.sparse.remote if self.sparse is not None else None
        if remote is not None and seq.num_computed_tokens == 0 and seq.handoff is None:
            # prefix reuse: prompt blocks another request put to the store are not recomputed
            kv = remote.reusable_prefix(seq.token_ids[:seq.num_prompt_tokens])
            if kv is not None:
                seq.prefix_kv, seq.num_computed_tokens = kv.to(self.runner.device_kv.dtype), (
                    kv.shape[3])
                self.counters["prefix_reused_tokens"] += kv.shape[3]
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self.counters["requests_added"] += 1
        return seq.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prefix_kv: torch.Tensor | None = None,
                    transfer: str | None = None) -> str:
        """`transfer` ("partial" or "full"; prefill worker): after its prompt and one decode
        step the request finishes with reason "handoff", its output carrying the Handoff for
        a decode worker (`add_handoff`); its prompt blocks stay in the remote store."""
        seq = self.make_sequence(prompt, params, request_id, prefix_kv)
        if transfer is not None:
            self._check_remote("a hand-over")
            if transfer not in TRANSFERS:
                raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
            seq.transfer = transfer
        return self.add_sequence(seq)

    def add_handoff(self, handoff: Handoff, params: SamplingParams) -> str:
        """Decode worker: continues a request a prefill worker handed over (`params` as the
        client sent them). Its prompt blocks stay in the shared remote store; the kept ones
        are read at admission, the others when a step wants them."""
        return self.add_sequence(self.make_handoff_sequence(handoff, params))

    def make_handoff_sequence(self, handoff: Handoff, params: SamplingParams) -> Sequence:
        """`add_handoff`'s checks and request, not yet added (a server validates on its
        request's thread and adds between steps, as `make_sequence`)."""
        self._check_remote("a handed-over request")
        h, mc, B = handoff, self.model_config, self.config.cache.block_size
        L, _, hkv, _, d = h.tail.shape
        if (L, hkv, d, h.block_size) != (mc.num_layers, mc.num_kv_heads, mc.head_dim, B):
            raise ValueError(f"hand-over of request {h.request_id!r} has {L} layers x {hkv} KV "
                             f"heads x head_dim {d}, block {h.block_size}; this engine has "
                             f"{mc.num_layers} x {mc.num_kv_heads} x {mc.head_dim}, block {B}")
        if h.head_map.shape[1] != self.config.cache.top_k:
            raise ValueError(f"hand-over of request {h.request_id!r} has working sets of top_k "
                             f"{h.head_map.shape[1]}, this engine's top_k is "
                             f"{self.config.cache.top_k}")
        if h.summary_splits != self.config.cache.summary_splits:
            raise ValueError(f"hand-over of request {h.request_id!r} has summary_splits "
                             f"{h.summary_splits}, this engine's is "
                             f"{self.config.cache.summary_splits}: set it alike on both workers")
        cache = self.config.cache
        ours = cache.key_copy_bits if cache.key_copy else None
        theirs = None if h.key_codes is None else (8 if h.key_codes.dtype == torch.int8 else 4)
        if ours != theirs:
            def kind(bits: int | None) -> str:
                return "no key copy" if bits is None else f"an int{bits} key copy"
            raise ValueError(f"hand-over of request {h.request_id!r} has {kind(theirs)}, this "
                             f"engine reranks from {kind(ours)}: set rerank and rerank_source "
                             "alike on both workers")
        if h.request_id in self.requests:
            raise ValueError(f"request id {h.request_id!r} is already in use")
        max_context = min(h.num_prompt_tokens + params.max_tokens, self.max_model_len)
        if len(h.token_ids) >= max_context:
            raise ValueError(f"request {h.request_id!r} has {len(h.token_ids)} tokens, its "
                             f"max_context is {max_context}: nothing left to decode")
        P = h.num_prompt_blocks
        budget = self.sparse.remote.capacity(P) + self.host_pool.blocks_for(max_context) - P
        problem = self.kv.fits_alone(max_context, host_blocks=budget)
        if problem:
            raise ValueError(problem)
        seq = Sequence(h.request_id, list(h.token_ids), h.num_prompt_tokens, params,
                       prompt=h.prompt, max_context=max_context, metrics=h.metrics,
                       num_computed_tokens=h.num_computed_tokens, handoff=h,
                       host_budget=budget, draft_tokens=list(h.draft_tokens),
                       draft_weights=h.draft_weights)
        if h.generator_state is not None:
            seq.generator = torch.Generator()
            seq.generator.set_state(h.generator_state)
        seq.output_text = self.decode(seq)
        return seq

    def _check_remote(self, what: str) -> None:
        if self.sparse is None or self.sparse.remote is None:
            raise ValueError(f"{what} needs kv_mode=sparse and a remote_store shared with the "
                             "other worker (inprocess://NAME or mooncake://HOST:PORT)")

    def close(self) -> None:
        """Stops the prefetch workers (pending jobs finish first)."""
        if self.sparse is not None:
            self.sparse.flush()
            self.sparse.pipeline.close()
            if self.sparse.remote is not None:
                self.sparse.remote.close()

    def trace(self) -> Tracer:
        """Starts recording a Chrome trace of the prefetch pipeline and the foreground layers
        (sparse mode); write it with `.write(path)`."""
        tracer = Tracer()
        if self.sparse is not None:
            self.sparse.pipeline.tracer = self.sparse.pipeline.executor.tracer = tracer
        return tracer

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_invariants(self, foreign_namespaces: set[str] = frozenset()) -> None:
        """Raises InvariantError naming every broken invariant (`engine/invariants.py`);
        `foreign_namespaces`: store namespaces another engine's live requests hold."""
        check_invariants(self, foreign_namespaces)

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns an output for every request that made progress or ended.
        An exception fails the requests it concerns, never the engine (`failures.py`)."""
        batch = self.scheduler.schedule()
        if not batch:
            return self._fail_stuck()
        failures = StepFailures(lambda seq, error: self._finish(seq, "error", error=error))
        if self.sparse is not None and self.sparse.remote is not None:
            remote_steps.receive(self, batch, failures)
        batch = [(seq, n) for seq, n in batch if not seq.is_finished]
        seqs = self._run(batch, failures) if batch else []
        return [self._output(seq)
                for seq in seqs + [f for f in failures.failed if all(f is not s for s in seqs)]]

    def _run(self, batch: ScheduledBatch, failures: StepFailures) -> list[Sequence]:
        """The batch's forward pass and sampling, then each request's share of the step;
        returns the requests that sampled."""
        now = time.perf_counter()
        for seq, _ in batch:
            seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
        samplers = [(seq, row) for (seq, n), row in zip(batch, self._last_rows(batch), strict=True)
                    if seq.num_computed_tokens + n == seq.num_tokens]
        try:
            logits, draft_logits, features = self.runner.run(batch, [row for _, row in samplers])
            for hook in self.step_hooks:
                hook(batch)
            seqs = [seq for seq, _ in samplers]
            drafts = {id(seq): dl for (seq, _), dl in zip(batch, draft_logits, strict=True)}
            draft_features = {id(seq): f[n:] for (seq, n), f in zip(batch, features, strict=True)
                              if f is not None}
            tokens = self._sample(logits, seqs, drafts)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the engine
            self.counters["step_failures"] += 1
            failures.forward_failed(batch, e)
            return []
        # The forward pass wrote every request's K/V: all of them advance, before anything
        # that can fail for one of them alone.
        self.counters["steps"] += 1
        done = time.perf_counter()
        entry = {"step": self.counters["steps"], "seqs": len(batch), "prefill_tokens": 0,
                 "decode_tokens": 0, "time_s": done - now}
        for seq, n in batch:
            seq.suspect = False
            entry["decode_tokens" if is_decode(seq, n) else "prefill_tokens"] += n
            seq.num_computed_tokens += n
        for key in ("prefill_tokens", "decode_tokens"):
            self.counters[key] += entry[key]
        if self.sparse is not None:
            entry.update(vars(self.sparse.last_step))
        self.step_log.append(entry)
        for (seq, n), feats in zip(batch, features, strict=True):
            if feats is not None:
                with failures.guard(seq, "the drafter's observe"):
                    self.drafter.observe(seq.request_id, seq.num_computed_tokens - n, feats[:n])
        remote = self.sparse is not None and self.sparse.remote is not None
        if remote:
            remote_steps.fail_fetches(batch, failures)
        for seq, (token, accepted) in zip(seqs, tokens, strict=True):
            if not seq.is_finished:
                with failures.guard(seq, "taking its sampled token"):
                    self._advance(seq, token, accepted, drafts[id(seq)], done,
                                  draft_features.get(id(seq)))
        if remote:
            remote_steps.store_prompts(self, batch, failures)
            remote_steps.hand_off(self, seqs, failures)
        return seqs

    def _advance(self, seq: Sequence, token: int | Exception, accepted: bool,
                 draft_row: torch.Tensor | None, now: float,
                 draft_features: torch.Tensor | None = None) -> None:
        """Appends the step's token(s) to a request and prepares its next drafts."""
        if draft_row is not None:
            right = seq.draft_tokens[0] == token
            self.counters["drafts"] += 1
            self.counters["drafts_right"] += right
            seq.metrics.num_drafts += 1
            seq.metrics.num_drafts_right += right
        self._append(seq, token, now)
        if accepted and not seq.is_finished:
            # The first draft was this token: its K/V (computed as a draft row) is kept and
            # its row's logits give one more token this step.
            self.runner.commit_draft(seq)
            if draft_features is not None:  # the accepted draft row's are the true ones
                self.drafter.observe(seq.request_id, seq.num_computed_tokens, draft_features[:1])
            seq.num_computed_tokens += 1
            self.counters["decode_tokens"] += 1
            self.counters["spec_accepted"] += 1
            self._append(seq, sample(draft_row[:1], [seq.params], [self._generator(seq)])[0],
                         now)
        if self.drafter is None or seq.is_finished:
            return
        forced = self._forced(seq) if self.config.spec.forced_drafts == "known" else None
        if forced is not None:
            # teacher forcing: the next token is known, so the lookahead need not guess it
            # (nor guess others); drafters catch up on skipped tokens
            seq.draft_tokens, seq.draft_weights = [forced], None
            return
        right_row = chained_draft(seq.draft_tokens, token)
        prev = seq.draft_tokens[right_row] if seq.draft_tokens else None
        chain = None if accepted or draft_row is None else draft_row[right_row]
        try:
            seq.draft_tokens, probs = self.drafter.propose_weighted(
                seq.token_ids, chain, prev, self.config.spec.num_drafts, seq.request_id)
            seq.draft_weights = sampling_weights(probs, len(seq.draft_tokens),
                                                 seq.params.temperature)
        except Exception as e:  # noqa: BLE001 - a draft is a hint, never a failure
            log.warning("drafter failed for request %s: %r", seq.request_id, e)
            seq.draft_tokens, seq.draft_weights = [], None

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                drafts: dict[int, torch.Tensor | None]) -> list[tuple[int | Exception, bool]]:
        """(token or the row's exception, whether it is an accepted draft) per sampling row.
        With speculative acceptance a request whose draft rode along verifies it instead."""
        verify = [self.speculative and drafts[id(s)] is not None and not self._forced(s)
                  for s in seqs]
        plain = [i for i, v in enumerate(verify) if not v]
        out: list[tuple[int | Exception, bool]] = [(0, False)] * len(seqs)
        sampled = sample(logits[plain], [seqs[i].params for i in plain],
                         [self._generator(seqs[i]) for i in plain])
        for i, token in zip(plain, sampled, strict=True):
            forced = self._forced(seqs[i])
            out[i] = (forced if forced is not None else token, False)
        for i, s in enumerate(seqs):
            if s.params.logprobs and isinstance(out[i][0], int):
                s.logprobs.append(float(torch.log_softmax(logits[i], -1)[out[i][0]]))
        for i in (i for i, v in enumerate(verify) if v):
            s = seqs[i]
            try:
                out[i] = verify_draft(logits[i], s.draft_tokens[0], s.params, self._generator(s))
            except Exception as e:  # noqa: BLE001 - reported per request
                out[i] = (e, False)
        return out

    @staticmethod
    def _forced(seq: Sequence) -> int | None:
        forced = seq.params.forced_tokens
        return forced[seq.num_output_tokens] if seq.num_output_tokens < len(forced) else None

    def _generator(self, seq: Sequence) -> torch.Generator:
        return seq.generator or self.default_generator

    def _append(self, seq: Sequence, token: int | Exception, now: float) -> None:
        """Adds a sampled token (or fails the request with the sampling error), then checks
        the stop conditions."""
        if isinstance(token, Exception):
            log.error("request %s failed in sampling: %r", seq.request_id, token)
            self._finish(seq, "error", error=f"{type(token).__name__}: {token}")
            return
        seq.token_ids.append(token)
        seq.metrics.num_generated_tokens = seq.num_output_tokens
        seq.metrics.first_token_time = seq.metrics.first_token_time or now
        self._check_stop(seq, token)

    @staticmethod
    def _last_rows(batch: ScheduledBatch) -> list[int]:
        return [end - 1 for end in itertools.accumulate(n for _, n in batch)]

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.stop_reason = token
            return self._finish(seq, "stop", drop_last=True)
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return self._finish(seq, "stop", drop_last=True)
        seq.output_text = self.decode(seq)
        for s in p.stop:
            idx = seq.output_text.find(s)
            if idx >= 0:
                seq.stop_reason = s
                seq.output_text = seq.output_text[:idx + (len(s) if p.include_stop_str_in_output
                                                          else 0)]
                return self._finish(seq, "stop", decode=False)
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", decode=False)

    def decode(self, seq: Sequence, drop_last: bool = False) -> str:
        ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None,
                drop_last: bool = False, decode: bool = True) -> None:
        if decode:
            seq.output_text = self.decode(seq, drop_last=drop_last)
        seq.finish_reason, seq.error = reason, error
        seq.metrics.finish_time = time.perf_counter()
        seq.metrics.num_generated_tokens = seq.num_output_tokens - drop_last
        if self.sparse is not None:
            # no block is freed while a prefetch job may still write it (a failed job's
            # siblings in other layers too): the next request to get it would see that write
            self.sparse.release(seq)
            if seq.host_cache is not None:
                self.host_cache_peak = max(self.host_cache_peak, seq.host_cache.peak)
            if self.sparse.remote is not None and reason != "handoff":  # handed over: its
                self.sparse.remote.drop_request(seq)  # blocks go on with the decode worker
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        self.counters["requests_failed" if reason == "error" else "requests_finished"] += 1
        if self.drafter is not None:
            try:
                self.drafter.release(seq.request_id)
            except Exception as e:  # noqa: BLE001 - its state is a hint; the request is over
                log.warning("drafter failed to release request %s: %r", seq.request_id, e)

    def _fail_stuck(self) -> list[RequestOutput]:
        # Unreachable when validation holds: a lone request always fits the pool.
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        self._finish(seq, "error", error="request does not fit the KV pool")
        return [self._output(seq)]

    def _output(self, seq: Sequence) -> RequestOutput:
        out_ids = seq.output_token_ids[:seq.metrics.num_generated_tokens]  # no EOS / stop id
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens], text=seq.output_text,
            token_ids=out_ids, finished=seq.is_finished, finish_reason=seq.finish_reason,
            metrics=seq.metrics, stop_reason=seq.stop_reason, error=seq.error,
            logprobs=seq.logprobs[:len(out_ids)] if seq.params.logprobs else None,
            handoff=seq.handoff if seq.finish_reason == "handoff" else None)

    # ---- counters -------------------------------------------------------------------------

    def _host_cache_stats(self) -> dict:
        """Remote store traffic and, per running request with a host cache, its blocks on the
        decode host (fullest layer, generated blocks included), peak and budget."""
        c = self.sparse.counters
        caches = {s.request_id: s.host_cache for s in self.scheduler.running if s.host_cache}
        peak = max([self.host_cache_peak] + [h.peak for h in caches.values()])
        return {"remote_bytes": c.remote_bytes, "remote_put_bytes": c.remote_put_bytes,
                "remote_blocks": c.remote_blocks, "host_evictions": c.host_evictions,
                "host_cache_peak_blocks": peak,
                "host_cache": {rid: {"blocks": h.resident(), "peak": h.peak,
                                     "budget": h.budget} for rid, h in caches.items()}}

    def stats(self) -> dict:
        used = self.pool.num_used
        block_bytes = self.device_split.block_bytes  # sparse: a slab block, its sparse layers
        sparse = {}
        if self.sparse is not None:
            self.sparse.flush()  # count the jobs still in flight
            c = self.sparse.counters
            sparse = {f"sparse_{k}": v for k, v in vars(c).items()}
            sparse.update(host_blocks_used=self.host_pool.num_used,
                          host_blocks_total=self.host_pool.num_blocks,
                          host_bytes_held=self.host_pool.num_used * self.bytes_per_block,
                          host_peak_bytes=self.host_pool.peak_used * self.bytes_per_block,
                          slab_bytes=self.config.cache.slab_blocks * block_bytes,
                          fetch_cap=self.sparse.fetch_cap)
            if self.sparse.remote is not None:
                sparse.update(self._host_cache_stats())
        return {**self.counters, **sparse,
                "preemptions": self.scheduler.num_preemptions,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_blocks_used": used,
                "kv_blocks_total": self.pool.num_blocks,
                "kv_bytes_held": used * block_bytes,
                "kv_peak_blocks": self.pool.peak_used,
                "kv_peak_bytes": self.pool.peak_used * block_bytes,
                "kv_bytes_per_block": block_bytes, **device_memory(self)}

