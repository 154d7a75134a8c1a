"""Prefill-decode disaggregation (paper §3.3.1): a prefill worker computes prompts and hands
requests over after one decode step; a decode worker continues them, reading the prompt blocks
it needs from the remote store, never holding a full copy of a prompt's KV (partial transfer).

The prefill worker runs in this process (`LocalPrefill`, any remote store) or in a child
process (`ProcessPrefill`, a Mooncake store: the prompt blocks stay in the child's memory, lent
to the store, and the decode worker reads them from there). Requests and hand-overs (tokens,
summaries, the active block, working sets) cross a pipe; KV blocks cross the store.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
import traceback
import uuid
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.engine.invariants import live_namespaces
from oasiskv.outputs import RequestOutput
from oasiskv.sampling_params import SamplingParams
from oasiskv.sequence import RequestMetrics


@dataclass
class PrefillRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    transfer: str  # "partial" | "full"
    prefix_kv: torch.Tensor | None = None  # see LLMEngine.make_sequence


def _failed(request_id: str, error: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], text="",
                         token_ids=[], finished=True, finish_reason="error",
                         metrics=RequestMetrics(time.perf_counter()), error=error)


class LocalPrefill:
    """The prefill engine in this process; `poll` runs one of its steps."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)

    def submit(self, req: PrefillRequest) -> RequestOutput | None:
        """Queues a request; a request the engine refuses comes back as a failed output."""
        try:
            self.engine.add_request(req.prompt, req.params, req.request_id, req.prefix_kv,
                                    transfer=req.transfer)
        except ValueError as e:
            return _failed(req.request_id, str(e))
        return None

    @property
    def idle(self) -> bool:
        """Nothing left to do: every request it took has come out of `poll`."""
        return not self.engine.has_unfinished()

    def poll(self) -> list[RequestOutput]:
        """Finished outputs: hand-overs, and requests that ended on the prefill worker."""
        if not self.engine.has_unfinished():
            return []
        return [o for o in self.engine.step() if o.finished]

    def close(self) -> None:
        self.engine.close()


class WorkerStartError(RuntimeError, ValueError):
    """The prefill worker's process did not start: its engine refused the settings (its
    message), it died (exit code) or it took too long. A ValueError, as bad settings are."""


def _prefill_main(config: EngineConfig, conn) -> None:  # noqa: ANN001 - a Connection
    try:
        worker = LocalPrefill(config)
    except Exception as e:  # the parent says why, rather than meeting a bare end of pipe
        if not isinstance(e, ValueError):
            traceback.print_exc()  # a bug, not bad settings: keep where it happened
        conn.send(("error", str(e) if isinstance(e, ValueError) else repr(e)))
        return
    conn.send("ready")
    try:
        while True:
            idle = not worker.engine.has_unfinished()
            while conn.poll(0.05 if idle else 0):
                req = conn.recv()
                if req is None:
                    return
                failed = worker.submit(req)
                if failed is not None:
                    conn.send(failed)
                idle = False
            for out in worker.poll():
                conn.send(out)
    finally:
        worker.close()


@dataclass
class ProcessPrefill:
    """The prefill engine in a child process (spawned: it inherits the caller's network
    namespace and environment, e.g. MC_TCP_BIND_ADDRESS)."""

    config: EngineConfig
    startup_s: float = 300.0
    _proc: mp.Process = field(init=False)
    _conn: object = field(init=False)

    def __post_init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_prefill_main, args=(self.config, child), daemon=True)
        self._proc.start()
        child.close()
        try:
            ready = self._conn.recv() if self._conn.poll(self.startup_s) else None
        except (EOFError, OSError):  # it died before a word: killed, or crashed
            self._proc.join(10)
            code = self._proc.exitcode
            self.close()
            how = (f"signal {signal.Signals(-code).name}" if code and code < 0
                   else f"exit code {code}")
            raise WorkerStartError(f"the prefill worker died while starting ({how})") from None
        if ready != "ready":
            self.close()
            raise WorkerStartError(
                f"the prefill worker did not start: {ready[1]}" if ready else
                f"the prefill worker did not start within {self.startup_s} s")

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def idle(self) -> bool:
        return False  # its own process: it may be busy (its death is noticed by `alive`)

    def submit(self, req: PrefillRequest) -> RequestOutput | None:
        try:
            self._conn.send(req)
        except OSError as e:  # the worker is gone
            return _failed(req.request_id, f"prefill worker is gone: {e!r}")
        return None

    def poll(self) -> list[RequestOutput]:
        outs = []
        try:
            while self._conn.poll(0):
                outs.append(self._conn.recv())
        except (EOFError, OSError):
            pass
        return outs

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


class DisaggregatedLLM:
    """A prefill worker and a decode worker (this process) behind the batch API of `LLM`.

    `remote_store`: "inprocess://NAME" (default, one node: both engines here) or
    "mooncake://HOST:PORT" (the prefill worker in a child process, its memory lent to the
    store; this decode worker lends none). Engine settings are shared; `prefill` and `decode`
    override them per worker (e.g. f_host for the decode worker).
    """

    def __init__(self, model: str = "smollm2-135m", transfer: str = "partial",
                 remote_store: str | None = None, prefill: dict | None = None,
                 decode: dict | None = None, **kwargs) -> None:
        remote_store = remote_store or f"inprocess://pd-{uuid.uuid4().hex[:8]}"
        kwargs = {"kv_mode": "sparse", **kwargs, "model": model, "remote_store": remote_store}
        mooncake = remote_store.startswith("mooncake://")
        # Mooncake: the prefill worker's lent memory holds its prompts until they are decoded
        # (a 7K-token SmolLM2 prompt is 330 MiB in fp32); the decode worker lends none.
        prefill_config = EngineConfig.from_kwargs(
            **{**({"remote_lend": "4GiB"} if mooncake else {}), **kwargs, **(prefill or {})})
        self.transfer = transfer
        decode_config = EngineConfig.from_kwargs(
            **{**kwargs, **({"remote_lend": "0"} if mooncake else {}), **(decode or {})})
        splits = (prefill_config.cache.summary_splits, decode_config.cache.summary_splits)
        if splits[0] != splits[1]:  # a hand-over's summaries are installed as they are
            raise ValueError(f"summary_splits must be the same on both workers, got prefill "
                             f"{splits[0]}, decode {splits[1]}")
        copies = [c.cache.rerank_source if c.cache.key_copy else "none"
                  for c in (prefill_config, decode_config)]
        if copies[0] != copies[1]:  # a hand-over's key copy is installed as it is
            raise ValueError(f"the rerank's key copy must be the same on both workers, got "
                             f"prefill {copies[0]}, decode {copies[1]}")
        self.decode = LLMEngine(decode_config)
        try:
            self.prefill = ProcessPrefill(prefill_config) if mooncake else LocalPrefill(
                prefill_config)
        except BaseException:
            self.decode.close()  # no worker left behind by a failed start
            raise
        self.handoffs: dict[str, object] = {}  # request id -> its Handoff (for reports)

    def generate(self, prompts: Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, prefix_kv: Seq[torch.Tensor | None] | None = None,
                 on_step=None) -> list[RequestOutput]:  # noqa: ANN001
        """Outputs in prompt order. A request that fails (refused, a store read failed, the
        prefill worker died) ends with finish_reason "error"; the others go on. `on_step` is
        called after each decode step (benchmarks sample memory there)."""
        params = params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        prefix_kv = prefix_kv or [None] * len(prompts)
        ids = [f"pd{uuid.uuid4().hex[:6]}-{i}" for i in range(len(prompts))]
        outs: dict[str, RequestOutput] = {}
        by_id = dict(zip(ids, params, strict=True))
        for rid, prompt, p, kv in zip(ids, prompts, params, prefix_kv, strict=True):
            failed = self.prefill.submit(PrefillRequest(rid, prompt, p, self.transfer, kv))
            if failed is not None:
                outs[rid] = failed
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="pd")
        while len(outs) < len(ids):
            progressed = False
            for out in self.prefill.poll():
                progressed = True
                if out.finish_reason != "handoff":
                    outs[out.request_id] = out
                    continue
                self.handoffs[out.request_id] = out.handoff
                try:
                    self.decode.add_handoff(out.handoff, by_id[out.request_id])
                except ValueError as e:
                    self.decode.remote.drop_handoff(out.handoff)
                    outs[out.request_id] = _failed(out.request_id, str(e))
            if self.decode.has_unfinished():
                progressed = True
                for out in self.decode.step():
                    if out.finished:
                        outs[out.request_id] = out
                if on_step is not None:
                    on_step(self.decode)
            if isinstance(self.prefill, ProcessPrefill) and not self.prefill.alive:
                for rid in ids:  # whatever it had not handed over is lost with it
                    if rid not in outs and rid not in self.handoffs:
                        outs[rid] = _failed(rid, "the prefill worker died before handing it "
                                            "over")
            if not progressed and self.prefill.idle:
                # neither worker holds a request that has not come out: never wait for it
                for rid in ids:
                    if rid not in outs:
                        outs[rid] = _failed(rid, "internal error: the engines lost the request")
            elif not progressed and isinstance(self.prefill, ProcessPrefill):
                time.sleep(0.005)  # the prefill worker is busy in its own process
            if len(outs) > bar.n:
                bar.update(len(outs) - bar.n)
        bar.close()
        return [outs[rid] for rid in ids]

    def check_invariants(self) -> None:
        """Both engines' (`LLMEngine.check_invariants`), over the store they share: a namespace
        may be held by either worker's live requests. A prefill worker in its own process is
        not checked."""
        if isinstance(self.prefill, LocalPrefill):
            prefill = self.prefill.engine
            prefill.check_invariants(live_namespaces(self.decode))
            self.decode.check_invariants(live_namespaces(prefill))
        else:
            self.decode.check_invariants()

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
