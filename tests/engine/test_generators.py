"""`engine/generators.py`: sampling generators on the engine's device (a CPU generator cannot
sample CUDA logits), seeded sampling at temperature > 0 on OASISKV_TEST_DEVICE, and a
hand-over's generator state refused when it comes from another kind of device."""

from __future__ import annotations

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.engine import generators


def test_generators_are_made_on_the_device_asked(monkeypatch):
    """Checkable without a GPU: the device each generator is asked for (made on the CPU
    here, as this machine may have no CUDA)."""
    asked, real = [], torch.Generator

    def record(device="cpu"):
        asked.append(torch.device(device))
        return real()

    monkeypatch.setattr(torch, "Generator", record)
    generators.make_generator(torch.device("cuda:1"), 5)
    assert generators.request_generator(torch.device("cuda"), None) is None
    generators.request_generator(torch.device("cuda"), 7)
    generators.restore_generator(torch.device("cuda"), real().get_state(), "r")
    assert asked == [torch.device("cuda:1"), torch.device("cuda"), torch.device("cuda")]


def test_a_restored_generator_continues_and_a_foreign_state_is_refused():
    cpu = torch.device("cpu")
    g = generators.make_generator(cpu, 3)
    torch.rand(5, generator=g)
    again = generators.restore_generator(cpu, g.get_state(), "r1")
    assert torch.equal(torch.rand(5, generator=g), torch.rand(5, generator=again))
    cuda_state = torch.zeros(16, dtype=torch.uint8)  # a CUDA generator's: seed and offset
    with pytest.raises(ValueError, match=r"hand-over of request 'r1': its sampling "
                                         r"generator's state \(16 bytes\) does not fit a cpu"):
        generators.restore_generator(cpu, cuda_state, "r1")


def test_seeded_sampling_runs_on_the_engine_device(tiny_llama, test_device):
    """temperature > 0 on the test device: the engine's and each seeded request's generator
    live there, and a seed repeats its tokens (CUDA too: multinomial there needs them)."""
    llm = LLM(str(tiny_llama), device=test_device, device_kv_budget="1MiB")
    engine, device = llm.engine, torch.device(test_device)
    assert engine.default_generator.device.type == device.type
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=11, ignore_eos=True)
    assert engine.make_sequence([5, 6, 7], seeded).generator.device.type == device.type
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    first = [o.token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
    again = [o.token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
    assert first == again and all(len(t) == 12 for t in first)
    unseeded = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length"
               for o in llm.generate(prompts, unseeded, use_tqdm=False))
