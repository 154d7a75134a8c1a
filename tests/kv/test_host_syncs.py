"""No host synchronisation on the prefetch path: while the stages of a sparse decode step run
(predict, select, remote, local, fill: `kv/select_jobs.py`, `kv/slab_fill.py`), no torch call
that, on a CUDA device, stops the host until the device has caught up (each one serialises the
prefetch streams with the foreground).

Checked on the CPU with a TorchFunctionMode around every stage, since the same code runs on
both devices. What it refuses, and why:
- read-backs of a tensor's values: item, tolist, numpy, cpu, int(), float(), bool(), index
  use (__int__, __float__, __bool__, __index__);
- operations whose output size depends on the values (the host must learn the size first):
  nonzero, argwhere, one-argument where, masked_select, unique, boolean-mask indexing and
  assignment, repeat_interleave without output_size;
- tensors from Python data (torch.tensor, as_tensor, new_tensor): on CUDA a blocking copy
  from pageable memory (the foreground builds them once a step, `transfers.upload`);
- factories without a device (arange, full, zeros, ...): a CPU tensor that a CUDA stage would
  then copy over, blocking.
A device-to-host copy of device memory cannot be told apart on a CPU (there is one device):
the tier copies go through `kv/transfers.py` (non-blocking), which only a GPU run confirms.
"""

import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

import oasiskv.prefetch.executor as executor_mod
from oasiskv import LLM, SamplingParams
from oasiskv.kv import rerank, select, select_jobs, summaries

T = torch.Tensor
READ_BACKS = {T.item, T.tolist, T.numpy, T.cpu, T.__int__, T.__float__, T.__bool__,
              T.__index__}
VALUE_SIZED = {torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.masked_select,
               T.masked_select, torch.unique, T.unique, torch.unique_consecutive}
FROM_PYTHON = {torch.tensor, torch.as_tensor, T.new_tensor}
FACTORIES = {torch.arange, torch.full, torch.zeros, torch.ones, torch.empty, torch.rand,
             torch.randn, torch.randint, torch.eye, torch.linspace}


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def sync_reason(func, args, kwargs) -> str | None:
    """Why `func(*args, **kwargs)` would stop the host on CUDA, or None."""
    if func in READ_BACKS:
        return "reads a value back"
    if func in VALUE_SIZED:
        return "its output's size depends on the values"
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "one-argument where is nonzero"
    if func in (T.__getitem__, T.__setitem__) and _bool_index(args[1]):
        return "boolean-mask indexing is nonzero"
    if func in (torch.repeat_interleave, T.repeat_interleave) and "output_size" not in kwargs \
            and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor):
        return "repeat_interleave by a tensor without output_size"
    if func in FROM_PYTHON:
        return "a tensor from Python data"
    if func in FACTORIES and "device" not in kwargs:
        return "a factory without a device"
    return None


class HostSyncs(TorchFunctionMode):
    """Records each call that would synchronise the host, with where it came from."""

    def __init__(self, found: list) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            frame = next((f for f in reversed(traceback.extract_stack())
                          if "/oasiskv/" in f.filename), None)  # the engine's line
            where = "?" if frame is None else f"{frame.filename.split('/oasiskv/')[-1]}:" \
                f"{frame.lineno}"
            self.found.append(f"{getattr(func, '__name__', func)}: {reason} ({where})")
        return func(*args, **kwargs)


@pytest.fixture
def eager(monkeypatch):
    """The compiled functions run eagerly (the mode then sees their ops, not dynamo's)."""
    for fn in (select.weighted_scores, select.head_log_probs, select.group_logsumexp,
               rerank.candidate_mass, rerank.candidate_mass_codes, summaries._quantize_fused):
        monkeypatch.setattr(fn, "_run", fn.eager)


def stage_syncs(monkeypatch, llm_kwargs: dict, prompts: list[list[int]]) -> list[str]:
    """Runs a short sparse generation, every prefetch stage under HostSyncs."""
    found: list[str] = []
    real = executor_mod._run

    def watched(stage, fn, after, handle, tracer, label):
        def in_mode():
            with HostSyncs(found):
                fn()
        real(stage, in_mode, after, handle, tracer, label)

    monkeypatch.setattr(executor_mod, "_run", watched)
    # the CUDA path: on the CPU the local stage reads the admissions back (nothing to stall)
    monkeypatch.setattr(select_jobs, "compacts", lambda device: False)
    llm = LLM(**llm_kwargs)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.token_ids) == 24 for o in out)
    counts = llm.engine.sparse.counters
    assert counts.admitted > 0 and counts.hits > 0  # selection did run, with misses and hits
    return found


@pytest.mark.parametrize("options", [
    dict(predictor="previous"),
    dict(predictor="previous", rerank=1.5, rerank_source="host"),
    dict(predictor="previous", summary_splits=2, score_aggregation="softmax-sum"),
])
def test_no_prefetch_stage_synchronises_the_host(tiny_llama, monkeypatch, eager, options):
    """Two requests of 5-9 blocks with K = 3 and a cap of 1 (misses held back, blocks filled
    during decode), sync prefetch so that the stages run on this thread."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (90, 140)]
    found = stage_syncs(monkeypatch, dict(model=str(tiny_llama), kv_mode="sparse", top_k=3,
                                          f_hbm=0.34, prefetch="sync", max_num_seqs=2,
                                          **options), prompts)
    assert found == [], f"{len(found)} host syncs on the prefetch path:\n" + "\n".join(
        sorted(set(found)))


@pytest.mark.skipif(os.environ.get("OASISKV_TEST_DEVICE", "cpu") == "cpu",
                    reason="a GPU run (OASISKV_TEST_DEVICE=cuda): the CPU test above stands in")
def test_no_prefetch_stage_synchronises_a_cuda_device(tiny_llama, monkeypatch):
    """On CUDA, with the stream executor: torch's own sync check raises inside every stage
    (it sees what the CPU test cannot: device-to-host copies)."""
    real = executor_mod._run

    def strict(stage, fn, after, handle, tracer, label):
        def checked():
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        real(stage, checked, after, handle, tracer, label)

    monkeypatch.setattr(executor_mod, "_run", strict)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (90, 140)]
    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=3, f_hbm=0.34, prefetch="async",
              predictor="previous", max_num_seqs=2, device=os.environ["OASISKV_TEST_DEVICE"])
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.token_ids) == 24 for o in out)
    llm.engine.sparse.flush()
    assert llm.engine.sparse.counters.admitted > 0


def test_the_mode_sees_each_kind_of_sync():
    """The check itself: each refused call is recorded, an allowed one is not."""
    x, found = torch.arange(6), []
    with HostSyncs(found):
        int(x[0]), x.tolist(), x.nonzero(), x[x > 2], torch.tensor([1]), torch.arange(3)
        torch.arange(3, device=x.device), x.sum(), x[x.clamp(max=2)], len(x)
    assert [f.split(":")[0] for f in found] == [
        "__int__", "tolist", "nonzero", "__getitem__", "tensor", "arange"]
