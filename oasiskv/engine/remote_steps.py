"""A step's traffic with the remote store (sparse mode with a remote_store): a decode worker
installs the hand-overs of the requests it admits, a request whose prefill is done puts its
prompt blocks, a prefill worker hands requests over, and requests whose fetch failed end.

Each of these fails only the request it concerns (`StepFailures`), and a request that fails
leaves nothing in the store (`LLMEngine._finish` drops its namespaces).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oasiskv.engine.failures import StepFailures, describe
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.kv.handoff import receive_handoff, take_handoff
from oasiskv.sequence import Sequence
from oasiskv.store.remote_store import RemoteStoreError

if TYPE_CHECKING:
    from oasiskv.engine.engine import LLMEngine


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
            sparse.remote.remove(sparse.remote.namespace(seq.request_id))  # what got there
            failures.fail(seq, f"remote tier: storing the prompt of request {seq.request_id} "
                               f"failed: {_why(e)}")


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
                               f"{seq.request_id} failed: {_why(e)}")
            continue
        engine._finish(seq, "handoff")
