"""The remote store and hand-over lifecycle (sparse mode with a remote_store): admission of a
request that reuses prompt blocks another request put there, of a request a prefill worker
hands over (its checks, its host-cache budget), and each step's traffic: a decode worker
installs the hand-overs of the requests it admits, a request whose prefill is done puts its
prompt blocks, a prefill worker hands requests over, and requests whose fetch failed end.

Each of these fails only the request it concerns (`StepFailures`), and a request that fails
leaves nothing in the store (`LLMEngine._finish` drops its namespaces).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oasiskv.engine.failures import StepFailures, describe
from oasiskv.engine.generators import restore_generator
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.kv.handoff import TRANSFERS, Handoff, receive_handoff, take_handoff
from oasiskv.sampling_params import SamplingParams
from oasiskv.sequence import Sequence
from oasiskv.store.remote_store import RemoteStoreError, StoreFull

if TYPE_CHECKING:
    from oasiskv.engine.engine import LLMEngine


def check_remote(engine: LLMEngine, what: str) -> None:
    if engine.remote is None:
        raise ValueError(f"{what} needs kv_mode=sparse and a remote_store shared with the "
                         "other worker (inprocess://NAME or mooncake://HOST:PORT)")


def check_transfer(engine: LLMEngine, transfer: str) -> None:
    """A prefill worker's request that leaves after its first decode step (`add_request`)."""
    check_remote(engine, "a hand-over")
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")


def check_store_room(engine: LLMEngine, num_prompt_tokens: int) -> None:
    """A prompt whose complete blocks exceed the store's whole capacity (where the client
    knows it) could never be stored: refused at admission rather than after its prefill."""
    remote = engine.remote
    capacity = None if remote is None else remote.store.capacity_bytes
    if capacity is None:
        return
    need = (num_prompt_tokens // remote.block_size) * remote.prefix.num_layers * (
        remote.store.block_bytes)
    if need > capacity:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens: its complete blocks need "
                         f"{need} bytes of the remote store, whose capacity is {capacity} "
                         "bytes")


def reuse_prefix(engine: LLMEngine, seq: Sequence) -> None:
    """A new request whose prompt begins with blocks the prefix cache holds (put there by
    this or another engine on the store) reads their K/V instead of computing them again."""
    if engine.remote is None or seq.num_computed_tokens or seq.handoff is not None:
        return
    kv = engine.remote.reusable_prefix(seq.token_ids[:seq.num_prompt_tokens])
    if kv is not None:
        seq.prefix_kv, seq.num_computed_tokens = kv.to(engine.runner.device_kv.dtype), (
            kv.shape[3])
        engine.counters["prefix_reused_tokens"] += kv.shape[3]


def handoff_sequence(engine: LLMEngine, handoff: Handoff, params: SamplingParams) -> Sequence:
    """Decode worker: the request a hand-over continues, checked against this engine (the
    same model, block, top_k, summary splits and key copy as the prefill worker's), with the
    host blocks its cache may own; not yet added."""
    check_remote(engine, "a handed-over request")
    h, mc, B = handoff, engine.model_config, engine.config.cache.block_size
    L, _, hkv, _, d = h.tail.shape
    if (L, hkv, d, h.block_size) != (mc.num_layers, mc.num_kv_heads, mc.head_dim, B):
        raise ValueError(f"hand-over of request {h.request_id!r} has {L} layers x {hkv} KV "
                         f"heads x head_dim {d}, block {h.block_size}; this engine has "
                         f"{mc.num_layers} x {mc.num_kv_heads} x {mc.head_dim}, block {B}")
    if h.head_map.shape[1] != engine.config.cache.top_k:
        raise ValueError(f"hand-over of request {h.request_id!r} has working sets of top_k "
                         f"{h.head_map.shape[1]}, this engine's top_k is "
                         f"{engine.config.cache.top_k}")
    if h.summary_splits != engine.config.cache.summary_splits:
        raise ValueError(f"hand-over of request {h.request_id!r} has summary_splits "
                         f"{h.summary_splits}, this engine's is "
                         f"{engine.config.cache.summary_splits}: set it alike on both workers")
    cache = engine.config.cache
    if cache.bounds and h.kmin.shape[1] == 0 and h.num_computed_tokens >= B:
        raise ValueError(f"hand-over of request {h.request_id!r} has no block summaries "
                         f"(its engine reranks every block), this engine bounds blocks by "
                         f"them: set rerank alike on both workers")
    ours = cache.key_copy_bits if cache.key_copy else None
    theirs = None if h.key_codes is None else (8 if h.key_codes.dtype == torch.int8 else 4)
    if ours != theirs:
        def kind(bits: int | None) -> str:
            return "no key copy" if bits is None else f"an int{bits} key copy"
        raise ValueError(f"hand-over of request {h.request_id!r} has {kind(theirs)}, this "
                         f"engine reranks from {kind(ours)}: set rerank and rerank_source "
                         "alike on both workers")
    if h.request_id in engine.requests:
        raise ValueError(f"request id {h.request_id!r} is already in use")
    max_context = min(h.num_prompt_tokens + params.max_tokens, engine.max_model_len)
    if len(h.token_ids) >= max_context:
        raise ValueError(f"request {h.request_id!r} has {len(h.token_ids)} tokens, its "
                         f"max_context is {max_context}: nothing left to decode")
    P = h.num_prompt_blocks
    budget = engine.remote.capacity(P) + engine.host_pool.blocks_for(max_context) - P
    problem = engine.kv.fits_alone(max_context, host_blocks=budget)
    if problem:
        raise ValueError(problem)
    seq = Sequence(h.request_id, list(h.token_ids), h.num_prompt_tokens, params,
                   prompt=h.prompt, max_context=max_context, metrics=h.metrics,
                   num_computed_tokens=h.num_computed_tokens, handoff=h,
                   host_budget=budget, draft_tokens=list(h.draft_tokens),
                   draft_weights=h.draft_weights)
    if h.generator_state is not None:
        seq.generator = restore_generator(engine.device, h.generator_state, h.request_id)
    seq.output_text = engine.decode(seq)
    return seq



def _why(exc: Exception) -> str:
    # the store's own errors name the blocks; anything else its type
    return str(exc) if isinstance(exc, RemoteStoreError) else describe(exc)


def receive(engine: LLMEngine, batch: ScheduledBatch, failures: StepFailures) -> None:
    """Decode worker: installs the hand-overs of requests admitted this step; a request whose
    hand-over cannot be installed (its blocks unreadable) fails."""
    sparse = engine.sparse
    for seq, _ in batch:
        if seq.handoff is None or seq.host_cache is not None:
            continue
        try:
            read = receive_handoff(sparse, seq, seq.handoff)
        except Exception as e:  # noqa: BLE001 - fails this request only
            failures.fail(seq, f"remote tier: reading the hand-over of request "
                               f"{seq.request_id} failed: {_why(e)}")
            continue
        sparse.counters.handoff_bytes += read + seq.handoff.metadata_bytes


def fail_fetches(batch: ScheduledBatch, failures: StepFailures) -> None:
    """Requests whose remote fetch failed (this step or, with async prefetch, before): their
    working sets lack blocks, so they end with the store's error; the others go on."""
    for seq, _ in batch:
        if seq.host_cache is not None and seq.host_cache.error:
            failures.fail(seq, seq.host_cache.error)


def store_prompts(engine: LLMEngine, batch: ScheduledBatch, failures: StepFailures) -> None:
    """A request whose prefill this step completed puts its complete prompt blocks to the
    store and keeps a bounded host cache (after the step, so a failed step is redone on the
    whole host history)."""
    sparse = engine.sparse
    for seq, _ in batch:
        if (seq.is_finished or seq.host_cache is not None or seq.in_prefill
                or seq.num_computed_tokens < seq.num_prompt_tokens):
            continue
        try:
            sparse.store_prompt(seq)
            engine.kv.shrink_host(seq, seq.host_cache.owned)
        except Exception as e:  # noqa: BLE001 - fails this request only
            engine.remote.remove(engine.remote.namespace(seq.request_id))  # what got there
            failures.fail(seq, f"remote tier: storing the prompt of request {seq.request_id} "
                               f"failed: {_why(e)}", retryable=isinstance(e, StoreFull))


def hand_off(engine: LLMEngine, seqs: list[Sequence], failures: StepFailures) -> None:
    """Prefill worker: a request with a transfer mode leaves after its first decode step with
    what a decode worker needs (its prompt blocks stay in the store)."""
    sparse = engine.sparse
    for seq in seqs:
        if seq.transfer is None or seq.is_finished or seq.working_set is None:
            continue
        sparse.flush()  # the next step's blocks are chosen and fetched
        try:
            seq.handoff = take_handoff(sparse, seq, seq.transfer)
        except Exception as e:  # noqa: BLE001 - fails this request only
            failures.fail(seq, f"remote tier: putting the hand-over of request "
                               f"{seq.request_id} failed: {_why(e)}",
                          retryable=isinstance(e, StoreFull))
            continue
        engine._finish(seq, "handoff")
