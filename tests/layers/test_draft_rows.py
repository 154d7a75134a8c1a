"""Draft rows ride along with the normal token: they see its KV and their own, never write to
the cache, and leave the normal token's output untouched."""

import pytest
import torch

from oasiskv import LLM, SamplingParams


def prefilled(model_dir, prompt, **kw):
    llm = LLM(str(model_dir), device_kv_budget="4MiB", host_kv_budget="4MiB", **kw)
    seq = llm.engine.make_sequence(prompt, SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True))
    llm.engine.add_sequence(seq)
    llm.engine.step()  # prefill, samples x_t
    return llm, seq


@pytest.mark.parametrize("mode", [{}, {"kv_mode": "sparse", "top_k": 8}])
def test_oracle_draft_logits_equal_the_next_steps_and_normal_is_unchanged(tiny_llama, mode):
    prompt = list(range(3, 60))
    ref = LLM(str(tiny_llama)).generate([prompt], SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0].token_ids

    plain, seq0 = prefilled(tiny_llama, prompt, **mode)
    base = plain.engine.runner.run([(seq0, 1)], [0]).logits  # no drafts
    seq0.num_computed_tokens += 1
    seq0.token_ids.append(ref[1])
    next_step = plain.engine.runner.run([(seq0, 1)], [0]).logits  # dense truth of step t+1

    llm, seq = prefilled(tiny_llama, prompt, **mode)
    seq.draft_tokens = [ref[1], 7, 11]  # the oracle draft and two others
    sparse = llm.engine.sparse
    pool = sparse.host_kv if sparse else llm.engine.runner.device_kv  # [L, 2, Hkv, slots, d]
    pos, B = len(prompt), 16  # x_t's position; its slot in that pool:
    block = sparse.host_block(seq, pos // B) if sparse else seq.block_table[pos // B]
    slot = block * B + pos % B
    # NaN there first: torch.empty memory may hold x_t's K/V already (a freed pool of an
    # earlier engine that ran the same prompt), and the write would change nothing
    pool[:, :, :, slot] = float("nan")
    kv_before = pool.clone()
    logits, drafts, _ = llm.engine.runner.run([(seq, 1)], [0])
    torch.testing.assert_close(logits, base, atol=1e-5, rtol=1e-5)  # normal row unchanged
    torch.testing.assert_close(drafts[0][0], next_step[0], atol=1e-4, rtol=1e-4)
    assert drafts[0].shape[0] == 3
    # only x_t's K/V was written to the pool holding the history (sparse: the host tier,
    # written through from the slab): one token slot changed, no draft's
    after = sparse.host_kv if sparse else llm.engine.runner.device_kv
    same = (after == kv_before) | (after.isnan() & kv_before.isnan())  # torch.empty garbage
    changed = (~same).any(dim=-1)  # [L, 2, Hkv, slots]
    assert changed.any(dim=(0, 1, 2)).nonzero().flatten().tolist() == [slot]
