"""Equal requests sit side by side (device slabs, host histories), so a batch's working sets
and summaries are read as one strided view: tokens, selections and traffic equal those of the
same requests placed apart, each read on its own."""

import pytest

from oasiskv import LLM, SamplingParams
from oasiskv.kv.blocks import BlockPool
from oasiskv.prefetch.stages import SelectJob

PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
COUNTERS = ("sparse_predicted", "sparse_hits", "sparse_wanted", "sparse_admitted",
            "sparse_h2d_bytes")


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]], dict]:
    """(tokens, the running requests' block tables after the first step, stats)."""
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, PARAMS)
    engine.step()
    tables = [list(s.block_table) for s in engine.scheduler.running]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [outs[k] for k in sorted(outs, key=int)], tables, llm.stats()


@pytest.mark.parametrize("predictor", ["lookahead", "exact"])
def test_side_by_side_batch_equals_requests_placed_apart(tiny_llama, monkeypatch, predictor):
    top_k = 3
    kw = dict(kv_mode="sparse", top_k=top_k, f_hbm=0.34, prefetch="sync", predictor=predictor,
              max_num_seqs=4, max_num_batched_tokens=512)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(100)] for i in range(4)]
    strides = []
    stride_of = SelectJob._summary_stride

    def spy(self, n, num_ids):
        strides.append(stride_of(self, n, num_ids))
        return strides[-1]

    monkeypatch.setattr(SelectJob, "_summary_stride", spy)
    tokens, tables, stats = run(LLM(str(tiny_llama), **kw), prompts)
    slabs = sorted(t[0] for t in tables)
    assert slabs == [slabs[0] + i * (top_k + 1) for i in range(4)]  # side by side
    assert strides and all(s > 0 for s in strides)  # summaries scored as one view

    # the placement before side-by-side runs: slabs and histories apart
    monkeypatch.setattr(BlockPool, "take_run",
                        lambda self, table, n: self.grow(table, (len(table) + n) * self.block_size))
    strides.clear()
    ref_tokens, ref_tables, ref_stats = run(LLM(str(tiny_llama), **kw), prompts)
    ref_slabs = sorted(t[0] for t in ref_tables)
    assert ref_slabs != [ref_slabs[0] + i * (top_k + 1) for i in range(4)]
    assert strides and not any(strides)
    assert tokens == ref_tokens
    for key in COUNTERS:
        assert stats[key] == ref_stats[key], key
