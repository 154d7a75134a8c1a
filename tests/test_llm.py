"""The Python API: config validation; `parse_bytes`; prompt/params shapes accepted by
`generate`. That every config field is an `LLM(...)` keyword that takes effect:
test_config_fields.py."""

import pytest

from oasiskv import LLM, SamplingParams
from oasiskv.config import CacheConfig, EngineConfig, SchedulerConfig, parse_bytes

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 KV heads, head_dim 16, fp32


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 12}, "power of two"), ({"block_size": 0}, "power of two"),
    ({"block_size": -16}, "power of two"),
    ({"dtype": "float8"}, "dtype 'float8'"), ({"dtype": "int8"}, "dtype"),
    ({"device": "nonsense"}, "device"),
    ({"num_threads": 0}, "num_threads"),
    ({"device_kv_budget": "lots"}, "size in bytes"), ({"device_kv_budget": 0}, "positive"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"max_num_batched_tokens": -1},
                                            "max_num_batched_tokens"),
    ({"max_model_len": 0}, "max_model_len"), ({"summary_dtype": "int8"}, "summary_dtype"),
    ({"prefetch_group": -1}, "prefetch_group must be >= 0"),
    ({"max_num_seq": 4}, r"unknown config option.*max_num_seq"),
    ({"kv_mode": "sparse", "num_drafts": 17}, r"num_drafts is 17.*block_size 16"),
])
def test_config_validation(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_llama), **kwargs)
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_config_sections_validate_on_their_own():
    with pytest.raises(ValueError, match="power of two"):
        CacheConfig(block_size=24)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=-1)
    assert CacheConfig(block_size=32, device_kv_budget="2MiB").device_kv_budget == 2 * 2**20


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("0.5KiB", 512), ("2TiB", 2 * 2**40),
    ("1gib", 2**30), ("1.5k", 1500), ("1 GB", 10**9), (" 3 kb ", 3000), ("4096", 4096),
    ("7b", 7), ("2M", 2 * 10**6), (4096, 4096), (1e9, 10**9), (2.5e3, 2500),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["abc", "", "12XB", "-5", "GiB", "1.2.3GB", "5 G i B"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_parse_bytes_accepts_its_advertised_example():
    assert parse_bytes("1e9") == 10**9


# ---------------------------------------------------------------- generate's inputs


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device_kv_budget="1MiB")


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_generate_accepts_text_ids_and_lists_in_order(llm):
    texts = ["The quick brown fox", "It is a truth"]
    ids = [llm.tokenizer.encode(t) for t in texts]
    by_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in by_ids] == ids
    by_text = llm.generate(texts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in by_text] == [o.token_ids for o in by_ids]
    assert [o.prompt for o in by_text] == texts
    one = llm.generate(texts[1], GREEDY, use_tqdm=False)  # a single string
    assert len(one) == 1 and one[0].token_ids == by_ids[1].token_ids
    one = llm.generate(ids[0], GREEDY, use_tqdm=False)  # a single list of ids
    assert len(one) == 1 and one[0].token_ids == by_ids[0].token_ids
    # Per-prompt params, reversed order of lengths: outputs still follow prompt order.
    outs = llm.generate(ids, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                              for m in (6, 2)], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6, 2]
    assert outs[0].token_ids[:4] == by_ids[0].token_ids


def test_generate_rejects_bad_shapes(llm):
    with pytest.raises(ValueError, match="no prompts"):
        llm.generate([], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a b"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_stats_after_generate(llm):
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    s = llm.stats()
    assert s["kv_bytes_per_block"] == 16 * BYTES_PER_TOKEN
    assert s["kv_blocks_total"] == 2**20 // s["kv_bytes_per_block"]
    assert s["kv_blocks_used"] == s["kv_bytes_held"] == 0
    assert s["kv_peak_bytes"] == s["kv_peak_blocks"] * s["kv_bytes_per_block"] > 0
