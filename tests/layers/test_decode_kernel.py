"""The compiled decode-attention kernel (`layers/decode_kernel.py`, through `Attention.forward`)
equals the previous implementation (`layers/attention_ref.py`) and a brute-force float64
attention over expanded K/V: dense (one run, runs out of order), sparse masks, draft rows
(masks shared or their own), sparse slabs with their drafts in the draft slots, GQA groups of 1,
3 and 7, odd lengths, fp32 and bf16, on 1 and 2 threads, whole and split over the sequence
(log-sum-exp merge), each with every instruction set this CPU runs (avx512bf16: the bf16 scores
by vdpbf16ps); and the fallback to `layers/gqa.py` when the kernel cannot be built."""

import warnings
from collections.abc import Callable

import pytest
import torch
from test_gqa import brute  # the float64 truth, one copy

from oasiskv.context import SeqAttention, StepContext, set_context
from oasiskv.layers import decode_kernel, kernel_attention
from oasiskv.layers.attention import Attention, GqaAttention
from oasiskv.layers.attention_ref import ReferenceAttention

D = 16  # head dim
SLOTS = 700  # pool slots
ALL_ISAS = ["avx512bf16", "avx512", "avx2", "base"]  # best first, as the kernel lists them


def close_to_truth(got: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: to fp32 rounding; bf16: the fp32 result rounded once to bf16, at most half an ulp,
    2^-8 of the value (the reference rounds its scores and probabilities to bf16 too)."""
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=2**-8)
    torch.testing.assert_close(got.double(), truth, **tol)


def close_to_reference(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """The kernel, whatever the environment says (it is the default: OASISKV_ATTENTION unset)."""
    monkeypatch.setenv(decode_kernel.ENV, "kernel")


@pytest.fixture
def ext(kernel_on):
    e = decode_kernel.extension()
    assert e is not None, "the kernel builds and loads on this machine"
    return e


@pytest.fixture(params=ALL_ISAS)
def isa(request, ext, monkeypatch):
    """The kernel's loops on each instruction set this CPU runs (skipped where it does not)."""
    if request.param not in ext.isas():
        pytest.skip(f"this CPU does not run {request.param}")
    monkeypatch.setattr(kernel_attention, "ISA", request.param)
    return request.param


@pytest.fixture(params=[(1, 256), (2, 256), (2, 4)],
                ids=["1 thread", "2 threads", "2 threads, split"])
def threads(request, monkeypatch):
    """Requests x KV heads over the threads, or (MIN_CHUNK 4) each split into chunks."""
    n, chunk = request.param
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    monkeypatch.setattr(kernel_attention, "MIN_CHUNK", chunk)
    yield n
    torch.set_num_threads(before)


def layers(hkv: int, group: int, dtype: torch.dtype, g: torch.Generator, cls=Attention,
           d: int = D, device: str | torch.device = "cpu"):
    """The kernel's layer and the reference over the same random pools (drawn on the CPU, then
    moved to `device`: the same values on every device)."""
    pools = {"device": (torch.randn(hkv, SLOTS, d, generator=g).to(device, dtype),
                        torch.randn(hkv, SLOTS, d, generator=g).to(device, dtype))}
    new = cls(hkv * group, hkv, d, d ** -0.5)
    ref = ReferenceAttention(hkv * group, hkv, d, d ** -0.5)
    new.pools = ref.pools = pools
    new.layer_idx = ref.layer_idx = 0
    return new, ref


def run(layer: Attention, q, k, v, seqs: list[SeqAttention]) -> torch.Tensor:
    set_context(StepContext(seqs=seqs))  # the kernel's plan is built per context
    try:
        return layer(q, k, v)
    finally:
        set_context(None)


def layout(kind: str, t: int, first: int) -> tuple[dict, torch.Tensor]:
    """SeqAttention fields placing t token slots from `first` on, and those slots in order."""
    if kind == "one run":
        return {"kv_start": first}, torch.arange(first, first + t)
    cuts = [0, t // 3, 2 * t // 3, t]  # three runs, out of order in the pool
    firsts = [first + 2 * t // 3, first, first + t // 3]
    runs = [(f, b - a) for f, a, b in zip(firsts, cuts, cuts[1:], strict=False)]
    return {"kv_start": None, "kv_runs": runs}, torch.cat([torch.arange(f, f + n)
                                                          for f, n in runs])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,group", [(2, 1), (3, 3), (1, 7), (2, 7)])
@pytest.mark.parametrize("kind", ["one run", "runs"])
@pytest.mark.parametrize("masked", [False, True])
def test_decode_equals_reference_and_brute_force(isa, dtype, hkv, group, kind, masked, threads):
    g = torch.Generator().manual_seed(hkv * 10 + group)
    new, ref = layers(hkv, group, dtype, g)
    check_decodes(new, ref, g, kind, masked, [2, 7, 37, 173, 301], dtype)


def truth_of_row(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
                 _values: list[torch.Tensor]) -> None:
    """The check helpers' default brute-force check (values: the V rows the row weighs)."""
    close_to_truth(got, want, dtype)


def check_decodes(new: Attention, ref: Attention, g: torch.Generator, kind: str, masked: bool,
                  lengths: list[int], dtype: torch.dtype, device: str = "cpu",
                  truth: Callable = truth_of_row) -> None:
    """One decode per length (its K/V laid out as `kind`, masked or not) in new's device pool:
    new equals ref and a float64 brute force per row."""
    hkv, group = new.num_kv_heads, new.num_heads // new.num_kv_heads
    seqs, visible, first = [], [], 0
    for r, t in enumerate(lengths):  # odd lengths, one request each
        fields, slots = layout(kind, t, first)
        first += t
        valid = None
        if masked:
            valid = torch.rand(hkv, t, generator=g) > 0.4
            valid[:, -1] = True  # every head sees something
            valid = valid.to(device)
        seqs.append(SeqAttention(r, r + 1, t, kv_slots=None, kv_valid=valid, **fields))
        visible.append((slots, valid))
    q = torch.randn(len(seqs), hkv * group, D, generator=g).to(device, dtype)
    k, v = (torch.randn(len(seqs), hkv, D, generator=g).to(device, dtype) for _ in range(2))
    got, want = run(new, q, k, v, seqs), run(ref, q, k, v, seqs)
    close_to_reference(got, want, dtype)
    kc, vc = new.pools["device"]
    for r, (slots, valid) in enumerate(visible):
        truth(got[r], brute(q[r].float(), kc[:, slots].float(), vc[:, slots].float(), valid),
              dtype, [vc[:, slots]])

def drafts_case(dtype, group, kind, masks, g, hkv=2, t=45, m=3, d=D, device="cpu"):
    """One request with m drafts; the truth row by row (a draft's own K/V one more slot).
    Drawn on the CPU, the tensors then on `device`."""
    new, ref = layers(hkv, group, dtype, g, d=d, device=device)
    fields, slots = layout(kind, t, 100)
    valid = draft_valid = None
    if masks != "none":
        valid = torch.rand(hkv, t, generator=g) > 0.4
        valid[:, 0] = True
        valid = valid.to(device)
    if masks == "own":
        draft_valid = torch.rand(hkv, t, generator=g) > 0.4
        draft_valid[:, 0] = True
        draft_valid = draft_valid.to(device)
    seq = SeqAttention(0, 1, t, kv_slots=None, kv_valid=valid,
                       draft_rows=list(range(1, 1 + m)), draft_valid=draft_valid, **fields)
    q = torch.randn(1 + m, hkv * group, d, generator=g).to(device, dtype)
    k, v = (torch.randn(1 + m, hkv, d, generator=g).to(device, dtype) for _ in range(2))
    kc, vc = new.pools["device"]
    truths = []
    for row in range(1 + m):
        mask = valid if row == 0 or draft_valid is None else draft_valid
        keys, values = kc[:, slots].float(), vc[:, slots].float()
        mask = torch.ones(hkv, t, dtype=torch.bool, device=kc.device) if mask is None else mask
        if row:  # its own K/V as one more slot
            keys = torch.cat([keys, k[row, :, None].float()], 1)
            values = torch.cat([values, v[row, :, None].float()], 1)
            mask = torch.cat([mask, torch.ones(hkv, 1, dtype=torch.bool, device=kc.device)], 1)
        truths.append(brute(q[row].float(), keys, values, mask))
    return new, ref, (q, k, v, [seq]), truths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("kind", ["one run", "runs"])
@pytest.mark.parametrize("masks", ["none", "shared", "own"])
def test_draft_rows_equal_reference_and_brute_force(isa, dtype, group, kind, masks, threads):
    """Each draft sees the KV (under the drafts' mask) and its own K/V; the normal row the KV."""
    g = torch.Generator().manual_seed(group)
    new, ref, inputs, truths = drafts_case(dtype, group, kind, masks, g)
    got = run(new, *inputs)
    close_to_reference(got, run(ref, *inputs), dtype)
    for row, truth in enumerate(truths):
        close_to_truth(got[row], truth, dtype)


def check_slabs(new: Attention, ref: Attention, g: torch.Generator, starts: list[int], t: int,
                slots: int, drafts: int, dtype: torch.dtype, device: str = "cpu",
                truth: Callable = truth_of_row) -> None:
    """Sparse slabs of t tokens at `starts` in new's device pool (masks, `drafts` draft rows,
    their K/V in the draft slots as the runner leaves them): new equals ref and a float64 brute
    force per row (`truth`)."""
    hkv, group = new.num_kv_heads, new.num_heads // new.num_kv_heads
    n = 1 + drafts
    q = torch.randn(len(starts) * n, hkv * group, D, generator=g).to(device, dtype)
    k, v = (torch.randn(len(starts) * n, hkv, D, generator=g).to(device, dtype)
            for _ in range(2))
    seqs = []
    for r, start in enumerate(starts):
        valid = torch.rand(hkv, t, generator=g) > 0.3
        valid[:, 0] = True
        rows = list(range(r * n + 1, (r + 1) * n))
        seqs.append(SeqAttention(r * n, r * n + 1, t, start, None, kv_valid=valid.to(device),
                                 draft_rows=rows, draft_slots=slots))
        for pool, rows_kv in zip(new.pools["device"], (k, v), strict=True):
            pool[:, start + t:start + t + drafts] = rows_kv[rows].transpose(0, 1)
    got = run(new, q, k, v, seqs)
    close_to_reference(got, run(ref, q, k, v, seqs), dtype)
    kc, vc = new.pools["device"]
    for r, (start, seq) in enumerate(zip(starts, seqs, strict=True)):
        for i in range(n):
            extra = torch.arange(start + t, start + t + i)[i - 1:]  # a draft: its own slot
            cols = torch.cat([torch.arange(start, start + t), extra])
            mask = torch.cat([seq.kv_valid, torch.ones(hkv, len(extra), dtype=torch.bool,
                                                       device=device)], 1)
            truth(got[r * n + i], brute(q[r * n + i].float(), kc[:, cols].float(),
                                        vc[:, cols].float(), mask), dtype, [vc[:, cols]])


# window starts of 4 requests (a slab of 37 slots, then 4 draft slots: windows of 41)
SLAB_LAYOUTS = {"side by side": [5, 46, 87, 128], "apart": [5, 100, 200, 300], "alone": [77]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("drafts", [0, 1, 2])
@pytest.mark.parametrize("name", SLAB_LAYOUTS)
def test_slabs_equal_reference_and_brute_force(isa, dtype, group, drafts, name, threads):
    """Sparse slabs, their drafts' K/V in the draft slots as the runner leaves them."""
    hkv, t, slots = 2, 37, 4
    g = torch.Generator().manual_seed(drafts * 10 + group)
    new, ref = layers(hkv, group, dtype, g)
    check_slabs(new, ref, g, SLAB_LAYOUTS[name], t, slots, drafts, dtype)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 40, 64, 128])  # the generic loops (d not a multiple of the
# lanes, nor of the 32 bf16 vdpbf16ps takes: K read by masked loads) and the two fixed sizes
@pytest.mark.parametrize("group,drafts", [(3, 3), (1, 0), (3, 0), (7, 0), (1, 3), (7, 3)])
def test_each_instruction_set_equals_brute_force(ext, isa, dtype, d, group, drafts, monkeypatch):
    """Query rows (1 + drafts) x group: P.V's blocks of rows and their remainders."""
    if isa not in ext.isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setattr(kernel_attention, "ISA", isa)
    monkeypatch.setattr(kernel_attention, "MIN_CHUNK", 16)
    g = torch.Generator().manual_seed(d)
    new, _, inputs, truths = drafts_case(dtype, group, "runs", "own", g, t=301, m=drafts, d=d)
    got = run(new, *inputs)
    for row, truth in enumerate(truths):
        close_to_truth(got[row], truth, dtype)


def test_the_instruction_sets_follow_the_cpu_flags(ext, cpu_flags):
    """avx512bf16 is listed (first, as the best) exactly where the CPU has AVX-512 BF16."""
    flags = cpu_flags
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags
    want = (["avx512bf16"] if avx512 and "avx512_bf16" in flags else []) + (
        ["avx512"] if avx512 else []) + (["avx2"] if {"avx2", "fma"} <= flags else []) + ["base"]
    assert ext.isas() == want


@pytest.mark.parametrize("d", [40, 64])
def test_avx512bf16_runs_the_avx512_loops_for_fp32(ext, d, monkeypatch):
    """The avx512bf16 tier rounds nothing to bf16: fp32 inputs get the avx512 loops, bit for bit;
    bf16 inputs its own scores (the same to rounding: the brute-force checks above)."""
    if "avx512bf16" not in ext.isas():
        pytest.skip("this CPU does not run avx512bf16")
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        for isa in ("avx512bf16", "avx512"):
            monkeypatch.setattr(kernel_attention, "ISA", isa)
            g = torch.Generator().manual_seed(d)
            new, _, inputs, _ = drafts_case(dtype, 3, "runs", "own", g, t=301, d=d)
            got[dtype, isa] = run(new, *inputs)
    assert torch.equal(got[torch.float32, "avx512bf16"], got[torch.float32, "avx512"])
    close_to_reference(got[torch.bfloat16, "avx512bf16"], got[torch.bfloat16, "avx512"],
                       torch.bfloat16)


def test_an_unknown_instruction_set_or_a_run_outside_the_pool_raises(ext, monkeypatch):
    g = torch.Generator().manual_seed(0)
    new, _, (q, k, v, seqs), _ = drafts_case(torch.float32, 3, "one run", "none", g)
    monkeypatch.setattr(kernel_attention, "ISA", "sse1")
    with pytest.raises(RuntimeError, match="sse1 is not available"):
        run(new, q, k, v, seqs)
    monkeypatch.setattr(kernel_attention, "ISA", "")
    seqs[0].kv_start = SLOTS - 10  # 45 slots from there: past the pool's end
    with pytest.raises(RuntimeError, match="a run outside the pool"):
        run(new, q, k, v, seqs)


def test_falls_back_to_gqa_with_one_warning_when_the_kernel_cannot_build(tmp_path,
                                                                          monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error broken on purpose\n")
    monkeypatch.setenv("OASISKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(decode_kernel, "SOURCE", broken)
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    g = torch.Generator().manual_seed(1)
    new, ref, inputs, _ = drafts_case(torch.float32, 3, "runs", "shared", g)
    gqa, _ = layers(2, 3, torch.float32, g, GqaAttention)
    gqa.pools = new.pools
    with pytest.warns(RuntimeWarning, match="could not be built or loaded"):
        got = run(new, *inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        again = run(new, *inputs)
    assert torch.equal(got, run(gqa, *inputs)) and torch.equal(again, got)
    close_to_reference(got, run(ref, *inputs), torch.float32)


def test_the_kernel_is_the_default(monkeypatch):
    monkeypatch.delenv(decode_kernel.ENV)
    assert decode_kernel.wanted()


def test_the_environment_picks_gqa_or_refuses_a_bad_value(monkeypatch):
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    monkeypatch.setenv(decode_kernel.ENV, "gqa")
    assert decode_kernel.extension() is None and decode_kernel._loaded == {}  # nothing built
    g = torch.Generator().manual_seed(2)
    new, _, inputs, _ = drafts_case(torch.bfloat16, 7, "one run", "own", g)
    gqa, _ = layers(2, 7, torch.bfloat16, g, GqaAttention)
    gqa.pools = new.pools
    assert torch.equal(run(new, *inputs), run(gqa, *inputs))
    monkeypatch.setenv(decode_kernel.ENV, "fast")
    with pytest.raises(ValueError, match="OASISKV_ATTENTION='fast'"):
        decode_kernel.extension()
