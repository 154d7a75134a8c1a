"""Greedy generation is unchanged by the decode attention: the engine's tokens with the compiled
kernel (`Attention`, the default) and with the grouped matmuls (`GqaAttention`) equal those of
the same engine with the previous attention (`ReferenceAttention`) swapped in, dense and sparse
with K covering every block (masks, slabs, lookahead draft rows), in float32 and bfloat16."""

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.layers import decode_kernel
from oasiskv.layers.attention import Attention, GqaAttention
from oasiskv.layers.attention_ref import ReferenceAttention


def generate(model_dir, cls: type[Attention], **kw) -> list[list[int]]:
    llm = LLM(str(model_dir), max_num_batched_tokens=64, max_num_seqs=4, **kw)
    for m in llm.engine.model.modules():
        if type(m) is Attention:
            m.__class__ = cls
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 37, 61, 90)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("cls", [Attention, GqaAttention], ids=["kernel", "gqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", [{}, {"kv_mode": "sparse", "top_k": 16}])  # 16*16 > 90+24
def test_greedy_tokens_equal_the_reference_attentions(tiny_llama, cls, dtype, mode,
                                                     monkeypatch):
    monkeypatch.setenv(decode_kernel.ENV, "kernel")  # opt-in; GqaAttention never takes it
    assert cls is GqaAttention or decode_kernel.extension() is not None  # the kernel runs
    got = generate(tiny_llama, cls, dtype=dtype, **mode)
    want = generate(tiny_llama, ReferenceAttention, dtype=dtype, **mode)
    assert got == want
