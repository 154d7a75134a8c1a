"""Engines run step by step for test_config_fields.py, with what each step left behind
(working sets, drafts, the step log), and hand-computed references to hold them against."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from oasiskv import LLM, SamplingParams
from oasiskv.outputs import RequestOutput

B = 16  # tokens per block (the default block_size)
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * B  # K+V, 2 layers, 2 KV heads, head_dim 16, fp32
_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(3, 300, (n,), generator=_g).tolist() for n in (100, 130)]
LONG = torch.randint(3, 300, (250,), generator=_g).tolist()  # 15 blocks
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
# uncapped: each set is the step's pick; by the summary scores alone (the rerank's rows
# set it)
SPARSE = dict(kv_mode="sparse", top_k=3, f_hbm=1.0, rerank=0)



@dataclass
class Snap:
    """A running request after a step."""

    computed: int  # tokens whose K/V the engine holds
    tokens: list[int]
    drafts: list[int]
    head_map: torch.Tensor | None  # sparse: [L, K, Hkv] logical block per slot and KV head

    def held(self) -> list[list[set[int]]]:
        """Blocks resident per layer and KV head."""
        hm = self.head_map
        return [[{b for b in hm[layer, :, h].tolist() if b >= 0} for h in range(hm.shape[2])]
                for layer in range(hm.shape[0])]


@dataclass
class Run:
    outputs: list[RequestOutput]  # in prompt order
    stats: dict
    steps: list[dict[str, Snap]]  # after each step, the running requests by id
    log: list[dict] = field(default_factory=list)  # the engine's step log

    @property
    def tokens(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]

    def sets(self) -> list[dict[str, list[list[set[int]]]]]:
        return [{r: s.held() for r, s in step.items() if s.head_map is not None}
                for step in self.steps]

    def snaps(self) -> list[Snap]:
        return [s for step in self.steps for s in step.values() if s.head_map is not None]


_RUNS: dict[str, Run] = {}


def run(path: str, prompts: list[list[int]] = PROMPTS, params: SamplingParams = GREEDY,
        setup: Callable[[LLM], None] | None = None, **kwargs) -> Run:
    """Generates with `LLM(path, **kwargs)` step by step, recording each step. Runs without
    `setup` are deterministic and cached (a baseline serves several rows)."""
    key = repr((path, prompts, params, sorted(kwargs.items())))
    if setup is None and key in _RUNS:
        return _RUNS[key]
    llm = LLM(path, **kwargs)
    if setup is not None:
        setup(llm)
    engine = llm.engine
    ids = [engine.add_request(p, params, request_id=str(i)) for i, p in enumerate(prompts)]
    steps, outs = [], {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        if engine.sparse is not None:
            engine.sparse.flush()  # async: the step's selections land
        steps.append({r: Snap(s.num_computed_tokens, list(s.token_ids), list(s.draft_tokens),
                              None if s.working_set is None else s.working_set.head_map.clone())
                      for r, s in engine.requests.items() if not s.is_finished})
    result = Run([outs[i] for i in ids], llm.stats(), steps, list(engine.step_log))
    llm.close()
    if setup is None:
        _RUNS[key] = result
    return result


def resident_share(t: torch.Tensor) -> float:
    """Share of the tensor's memory pages that are mapped in (Linux mincore)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (ctypes.c_ubyte * (-(-length // page)))()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) == 0
    return sum(p & 1 for p in pages) / len(pages)


def pool_residency(path: str, prefault: bool) -> tuple[list[float | None], bool]:
    """Run in a fresh process (a long test process's heap may hand back pages that earlier
    tests touched): right after a sparse engine starts, the resident share of its device and
    host pools (None for a pinned one) and, with prefault, whether they and the summaries are
    all zero (read only then: reading maps pages in)."""
    from oasiskv import LLM

    llm = LLM(path, kv_mode="sparse", top_k=2, device_kv_budget="160MiB",
              host_kv_budget="128MiB", prefault_kv=prefault)
    sparse = llm.engine.sparse
    big = [sparse.device_kv, sparse.host_kv]
    assert min(p.numel() * p.element_size() for p in big) > 64 * 2**20
    shares = [None if p.is_pinned() else resident_share(p) for p in big]
    zero = prefault and not any(p.any() for p in big + [sparse.kmin, sparse.kmax])
    llm.close()
    return shares, zero


def most_admitted(r: Run) -> int:
    """Most blocks a KV head admitted in one step (the step's completed block aside), once
    capped: every step after a request's first has > top_k blocks to choose from here."""
    most = 0
    for before, after in zip(r.steps, r.steps[1:], strict=False):
        for rid, s in after.items():
            prev = before.get(rid)
            if prev is None or prev.head_map is None:
                continue
            filled = s.computed // B - 1
            for old, new in zip(prev.held(), s.held(), strict=True):
                most = max([most] + [len(n - o - {filled}) for o, n in zip(old, new, strict=True)])
    return most


def selections_match(want_of) -> tuple[list[bool], object]:  # noqa: ANN001
    """(seen, setup): `setup` makes an LLM's critical-path selection (predictor=exact) report,
    for each (step, layer, request) with a choice to make (more than top_k complete blocks),
    into `seen` whether every KV head's working set equals `want_of(layer, q, keys, sparse)`
    ([Hkv, K] block ids; q [Hkv, G, d] the step's query, keys [Hkv, n, B, d] exact)."""
    K, seen = SPARSE["top_k"], []

    def setup(llm: LLM) -> None:
        sparse = llm.engine.sparse
        prepare = sparse.prepare_layer

        def spy(layer: int, q: torch.Tensor) -> None:
            prepare(layer, q)  # selects for this step, on the critical path
            for d in sparse._decodes:
                n = d.pos // B
                if n <= K:
                    continue
                slots = (torch.tensor(d.seq.host_table[:n])[:, None] * B + torch.arange(B))
                keys = sparse.host_kv[layer, 0][:, slots]  # [Hkv, n, B, d]
                qg = q[d.attn.q_start].view(keys.shape[0], -1, keys.shape[-1])  # [Hkv, G, d]
                want = want_of(layer, qg, keys, sparse)
                held = d.seq.working_set.head_map[layer]  # [K, Hkv]
                seen.append(all(set(held[:, g].tolist()) == set(want[g].tolist())
                                for g in range(len(want))))

        sparse.prepare_layer = spy

    return seen, setup


def selections_like(path: str, alpha: float, aggregation: str = "sum",
                    prompts: list[list[int]] = PROMPTS, splits: int = 1, **kw) -> list[bool]:
    """Decodes with predictor=exact; for each (step, layer, request) with a choice to make,
    whether every KV head's working set is the top-K by the hand-computed score
    sum_h q_h.c + alpha*|q_h|.r over exact (fp32) min/max summaries; with `aggregation`
    softmax-sum / softmax-max, each query head's q_h.c + alpha*|q_h|.r softmaxed over the
    request's blocks at the layer's attention scale, then summed / the largest. With `splits`
    S, the min/max of each B/S-token sub-block, a block's score (per query head before the
    softmax; after the group's sum with sum) its sub-blocks' largest. Two prompts score as one
    batch (their summaries side by side), one alone."""
    def want_of(layer: int, qg: torch.Tensor, keys: torch.Tensor, sparse) -> torch.Tensor:  # noqa: ANN001
        sub = keys.unflatten(2, (splits, -1))  # [Hkv, n, S, B/S, d]
        lo, hi = sub.amin(3), sub.amax(3)  # [Hkv, n, S, d]
        per_head = ((qg[:, :, None, None] * ((hi + lo) / 2)[:, None]).sum(-1) + alpha *
                    (qg.abs()[:, :, None, None] * ((hi - lo) / 2)[:, None]).sum(-1))
        if aggregation == "sum":  # [Hkv, G, n, S] -> [Hkv, n]
            score = per_head.sum(1).amax(-1)
        else:
            per_head = per_head.amax(-1)  # [Hkv, G, n]
            probs = torch.softmax(per_head.double() * sparse.scales[layer], dim=-1)
            score = probs.sum(1) if aggregation == "softmax-sum" else probs.amax(1)
        return score.topk(SPARSE["top_k"]).indices  # [Hkv, K]

    seen, spy_on = selections_match(want_of)

    if aggregation != "sum":
        kw.setdefault("score_aggregation", aggregation)
    r = run(path, prompts, setup=spy_on, **SPARSE, predictor="exact", summary_dtype="float32",
            **kw)
    assert [o.finish_reason for o in r.outputs] == ["length"] * len(prompts)
    assert len(seen) > 20
    return seen


def drafts_by_step(r: Run) -> list[list[int]]:
    return [s.drafts for step in r.steps for s in step.values()]


def prompt_lookup(tokens: list[int]) -> int | None:
    for n in (3, 2, 1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # latest first
            if tokens[end - n + 1:end + 1] == tail:
                return tokens[end + 1]
    return None


def int8_keys(keys: torch.Tensor) -> torch.Tensor:
    """keys [..., B, d] as the int8 copy gives them back, written out by hand: per block and
    head, codes round(k / s) with s = max |k| / 127, times s."""
    s = keys.abs().amax(dim=(-2, -1), keepdim=True) / 127
    return torch.round(keys / s) * s


def reranks_like(path: str, quantized: bool, **kw) -> list[bool]:
    """Decodes with predictor=exact and rerank over every block (8 * top_k = 24 >= LONG's 17);
    for each (step, layer, request) with a choice to make, whether every KV head's working set
    is the top-K by the step query's attention mass per block (over complete blocks, summed
    over the head's query heads), from exact keys or from `int8_keys` of them."""
    def want_of(layer: int, qg: torch.Tensor, keys: torch.Tensor, sparse) -> torch.Tensor:  # noqa: ANN001
        if quantized:
            keys = int8_keys(keys)
        logits = torch.einsum("hgd,hnbd->hgnb", qg.double(), keys.double()) * sparse.scales[layer]
        probs = torch.softmax(logits.flatten(2), -1).view(logits.shape)
        return probs.sum((1, 3)).topk(SPARSE["top_k"]).indices  # [Hkv, K]

    seen, spy_on = selections_match(want_of)

    r = run(path, [LONG], setup=spy_on, **(SPARSE | {"rerank": 8}), predictor="exact", **kw)
    assert r.outputs[0].finish_reason == "length"
    assert len(seen) > 20
    return seen
