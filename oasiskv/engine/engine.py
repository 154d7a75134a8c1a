"""The engine: admits requests, steps the scheduler and the model, finishes requests.

Its other concerns live beside it: the KV tiers it builds (`kv_tiers.py`), drafting and
speculative acceptance (`drafting.py`), the remote store and hand-over lifecycle
(`remote_steps.py`), running a sequence outside the scheduler (`unscheduled.py`), loading
its model (`weights.py`), its figures (`stats.py`), failure isolation (`failures.py`) and
its invariants (`invariants.py`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from oasiskv.config import EngineConfig
from oasiskv.context import StepContext
from oasiskv.engine import drafting, generators, remote_steps, unscheduled
from oasiskv.engine.failures import StepFailures
from oasiskv.engine.invariants import check_invariants
from oasiskv.engine.kv_tiers import build_kv_tiers, close_tiers, trace_tiers
from oasiskv.engine.runner import StepOutput, is_decode
from oasiskv.engine.scheduler import ScheduledBatch, Scheduler
from oasiskv.engine.stats import engine_stats
from oasiskv.engine.weights import load_model
from oasiskv.kv.handoff import Handoff
from oasiskv.layers.sampler import sample
from oasiskv.outputs import RequestOutput
from oasiskv.prefetch.trace import Tracer
from oasiskv.sampling_params import SamplingParams
from oasiskv.sequence import Sequence
from oasiskv.spec.drafters import Drafter

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
        self.model, mc, self.tokenizer = load_model(config, share_weights)
        self.model_config = mc
        self.max_model_len = config.scheduler.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context "
                             f"{mc.max_position_embeddings}")
        if mc.sliding_window and self.max_model_len > mc.sliding_window:
            log.warning("model uses a %d-token sliding window; capping max_model_len to it",
                        mc.sliding_window)
            self.max_model_len = mc.sliding_window
        t = build_kv_tiers(self, self.model, config.cache, mc, config.torch_dtype, self.device,
                           self.max_model_len)
        self.bytes_per_block, self.device_split = t.bytes_per_block, t.device_split
        self.pool, self.host_pool, self.kv, self.runner = t.pool, t.host_pool, t.kv, t.runner
        self.sparse, self.remote = t.sparse, t.remote  # sparse mode; with a remote_store
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.default_generator = generators.make_generator(self.device, config.seed)
        self._ids = itertools.count()
        self.requests: dict[str, Sequence] = {}
        self.counters = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0,
                         "requests_added": 0, "requests_finished": 0, "requests_failed": 0,
                         "step_failures": 0, "drafts": 0, "drafts_right": 0, "spec_accepted": 0,
                         "prefix_reused_tokens": 0}
        self.host_cache_peak = 0  # remote store: most host blocks a finished request held
        self.speculative = config.spec.speculative == "accept"
        self.drafter: Drafter | None = None
        self.attach_drafter(drafting.build_drafter(config, mc, self.model,
                                                    LLMEngine.from_kwargs))
        self.scheduler.extra_decode_slots = int(self.speculative)
        self.runner.keep_draft_kv = self.speculative
        self.step_log: deque[dict] = deque(maxlen=100_000)  # per-step figures, newest last
        # Called with (batch) after each successful forward; tests use it to inject faults.
        self.step_hooks: list[Callable[[ScheduledBatch], None]] = []

    @classmethod
    def from_kwargs(cls, **kwargs) -> LLMEngine:
        """An engine of `EngineConfig.from_kwargs(**kwargs)` (the keywords of `LLM(...)`)."""
        return cls(EngineConfig.from_kwargs(**kwargs))

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
            self._check_vocab("prompt token ids", ids)
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
        remote_steps.check_store_room(self, len(ids))
        request_id = request_id or str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_vocab("forced tokens", params.forced_tokens)
        self._check_vocab("stop_token_ids", params.stop_token_ids)
        if prefix_kv is not None:
            prefix_kv = unscheduled.check_prefix_kv(self, prefix_kv, len(ids))
        gen = generators.request_generator(self.device, params.seed)
        seq = Sequence(request_id, ids, len(ids), params, prompt=text, generator=gen,
                       max_context=max_context, prefix_kv=prefix_kv)
        if prefix_kv is not None:
            seq.num_computed_tokens = prefix_kv.shape[3]
        return seq

    def _check_vocab(self, what: str, tokens: list) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab})")

    # ---- outside the scheduler ------------------------------------------------------------

    def forward(self, seq: Sequence, num_tokens: int | None = None,
                sample_rows: list[int] | None = None, aux_layers: tuple[int, ...] = (),
                edit_context: Callable[[StepContext], None] | None = None) -> StepOutput:
        """Runs the next tokens of a sequence that is not a request through the model, as a
        step that scheduled it alone would (`unscheduled.forward`)."""
        return unscheduled.forward(self, seq, num_tokens, sample_rows, aux_layers,
                                   edit_context)

    def free(self, seq: Sequence) -> None:
        """Gives back the blocks of a sequence `forward` ran."""
        self.kv.free(seq)

    def compute_prefix_kv(self, ids: list[int]) -> torch.Tensor:
        """The K/V [L, 2, Hkv, n, d] of `ids` for `add_request(prefix_kv=)` of this or another
        engine with the same model (`unscheduled.compute_prefix_kv`)."""
        return unscheduled.compute_prefix_kv(self, ids)

    def attach_drafter(self, drafter: Drafter | None) -> None:
        """Makes `drafter` the one the steps feed and ask (None: no drafter); the runner
        computes the outputs of its feature layers."""
        self.drafter = drafter
        self.runner.aux_layers = () if drafter is None else drafter.feature_layers

    @property
    def device_kv(self) -> torch.Tensor:
        """The device KV pool [L, 2, Hkv, slots, d] the steps write (sparse: the slabs)."""
        return self.runner.device_kv

    # ---- admission ------------------------------------------------------------------------

    def add_sequence(self, seq: Sequence) -> str:
        seq.metrics.num_prompt_tokens = seq.num_prompt_tokens
        remote_steps.reuse_prefix(self, seq)
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
            remote_steps.check_transfer(self, transfer)
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
        return remote_steps.handoff_sequence(self, handoff, params)

    def close(self) -> None:
        """Stops the prefetch workers (pending jobs finish first)."""
        close_tiers(self.sparse, self.remote)

    def trace(self) -> Tracer:
        """Starts recording a Chrome trace of the prefetch pipeline and the foreground layers
        (sparse mode); write it with `.write(path)`."""
        return trace_tiers(self.sparse)

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
        if self.remote is not None:
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
        drafting.observe(self.drafter, batch, features, failures)
        if self.remote is not None:
            remote_steps.fail_fetches(batch, failures)
        for seq, (token, accepted) in zip(seqs, tokens, strict=True):
            if not seq.is_finished:
                with failures.guard(seq, "taking its sampled token"):
                    self._advance(seq, token, accepted, drafts[id(seq)], done,
                                  draft_features.get(id(seq)))
        if self.remote is not None:
            remote_steps.store_prompts(self, batch, failures)
            remote_steps.hand_off(self, seqs, failures)
        return seqs

    def _advance(self, seq: Sequence, token: int | Exception, accepted: bool,
                 draft_row: torch.Tensor | None, now: float,
                 draft_features: torch.Tensor | None = None) -> None:
        """Appends the step's token(s) to a request and prepares its next drafts."""
        if draft_row is not None:
            drafting.count(self, seq, token)
        self._append(seq, token, now)
        if accepted and not seq.is_finished:
            # its draft row's logits give one more token this step
            drafting.accept(self, seq, draft_features)
            self._append(seq, sample(draft_row[:1], [seq.params], [self._generator(seq)])[0],
                         now)
        if self.drafter is not None and not seq.is_finished:
            drafting.propose(self, seq, token, accepted, draft_row)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                drafts: dict[int, torch.Tensor | None]) -> list[tuple[int | Exception, bool]]:
        """(token or the row's exception, whether it is an accepted draft) per sampling row.
        With speculative acceptance a request whose draft rode along verifies it instead."""
        forced = [drafting.forced_token(s) for s in seqs]
        verify = [self.speculative and drafts[id(s)] is not None and f is None
                  for s, f in zip(seqs, forced, strict=True)]
        plain = [i for i, v in enumerate(verify) if not v]
        out: list[tuple[int | Exception, bool]] = [(0, False)] * len(seqs)
        sampled = sample(logits[plain], [seqs[i].params for i in plain],
                         [self._generator(seqs[i]) for i in plain])
        for i, token in zip(plain, sampled, strict=True):
            out[i] = (forced[i] if forced[i] is not None else token, False)
        for i, s in enumerate(seqs):
            if s.params.logprobs and isinstance(out[i][0], int):
                s.logprobs.append(float(torch.log_softmax(logits[i], -1)[out[i][0]]))
        for i in (i for i, v in enumerate(verify) if v):
            out[i] = drafting.verify(self, logits[i], seqs[i])
        return out

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
            if self.remote is not None and reason != "handoff":  # handed over: its blocks
                self.remote.drop_request(seq)  # go on with the decode worker
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        self.counters["requests_failed" if reason == "error" else "requests_finished"] += 1
        if self.drafter is not None:
            drafting.release(self.drafter, seq)

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
            retryable=seq.retryable,
            logprobs=seq.logprobs[:len(out_ids)] if seq.params.logprobs else None,
            handoff=seq.handoff if seq.finish_reason == "handoff" else None)

    def stats(self) -> dict:
        """Counters, scheduler, pools and device memory (`stats.py`)."""
        return engine_stats(self)
