"""`bench decode`: tok/s divides only the tokens decoded while the clock runs. With chunked
prefill a short request finishes its prompt first and decodes while a long one still prefills;
those tokens come before the clock (which starts when the last request has its first token)
and must not be counted. The reference is what the engine's steps did, observed step by step.
The progress bar counts prompt tokens computed and tokens generated, ours and HF's."""

import io

import pytest
import torch
from tqdm import tqdm

from oasiskv import LLM
from oasiskv.bench import decode
from oasiskv.bench.decode import hf_decode, ours_decode
from oasiskv.bench.peers import load_hf
from oasiskv.cli import build_parser


def test_ours_counts_only_tokens_decoded_after_every_request_has_its_first(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_seqs=4, max_num_batched_tokens=32)
    engine, real_step = llm.engine, llm.engine.step
    steps, seqs = [], []  # per step: (tokens of each request before it, after it)

    def spy():
        seqs[:] = seqs or list(engine.requests.values())  # the batch, added before any step
        before = [s.num_output_tokens for s in seqs]
        out = real_step()
        steps.append((before, [s.num_output_tokens for s in seqs]))
        return out

    engine.step = spy
    prompts = [list(range(5, 15)), list(range(20, 140))]  # 10 and 120 tokens, 32 per step
    output_len = 12
    bar = tqdm(total=0, file=io.StringIO())
    got = ours_decode(llm, prompts, output_len, bar)
    # the clock's steps: those that began with both requests holding a token
    timed = [(b, a) for b, a in steps if len(b) == 2 and all(n > 0 for n in b)]
    want = sum(y - x for b, a in timed for x, y in zip(b, a, strict=True))
    assert got["decode_steps"] == len(timed)
    assert got["decoded"] == want
    # the case under test happened: the short request decoded during the long one's prefill
    assert got["decoded_before_clock"] > 0
    assert got["decoded"] + got["decoded_before_clock"] == len(prompts) * (output_len - 1)
    assert all(len(t) == output_len for t in got["tokens"])
    assert bar.n == sum(len(p) for p in prompts) + len(prompts) * output_len
    llm.close()


def test_hf_counts_every_row_after_its_first_token_and_agrees_with_ours(tiny_llama,
                                                                      test_device):
    """On OASISKV_TEST_DEVICE (conftest), HF and ours alike."""
    hf = load_hf(str(tiny_llama), torch.float32, test_device)
    assert hf.device.type == torch.device(test_device).type
    prompts = [list(range(5, 45)), list(range(50, 90))]  # equal lengths: no padding
    bar = tqdm(total=0, file=io.StringIO())
    got = hf_decode(hf, prompts, 9, bar)
    assert got["decode_steps"] == 8 and got["decoded"] == 2 * 8
    assert bar.n == 2 * 40 + 2 * 9
    llm = LLM(str(tiny_llama), max_num_seqs=2, device=test_device)
    ours = ours_decode(llm, prompts, 9)
    assert ours["tokens"] == got["tokens"]
    llm.close()


@pytest.mark.parametrize("batch", [1, 3])
def test_ours_decoded_is_every_later_token_when_prefills_end_together(tiny_llama, batch):
    # one prefill step for every prompt: nothing decodes before the clock
    llm = LLM(str(tiny_llama), max_num_seqs=batch, max_num_batched_tokens=512)
    got = ours_decode(llm, [list(range(5 + i, 25 + i)) for i in range(batch)], 6)
    assert got["decoded_before_clock"] == 0 and got["decoded"] == batch * 5
    llm.close()


def test_the_hf_peer_runs_on_the_engines_device(tiny_llama, monkeypatch, capsys):
    """`bench decode --device X` loads HF on X: a peer on another device would compare two
    devices, not two engines (checkable on the CPU: the device asked for)."""
    asked = []

    def record(model, dtype, device="not given"):
        asked.append(device)
        return load_hf(model, dtype)

    monkeypatch.setattr(decode, "load_hf", record)
    args = build_parser().parse_args(["bench", "decode", "--model", str(tiny_llama),
                                      "--context", "40", "--batch", "1", "--output-len", "2",
                                      "--device", "cpu"])
    rows = decode.run_decode_bench(args)
    assert asked == [torch.device("cpu")] and rows[0]["hf_tok_s"] > 0
