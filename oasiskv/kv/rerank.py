"""The rerank's second stage, batched: each KV head's best c blocks by summary score are
re-scored by the predicting query's softmax attention over their keys (the mass the `oracle`
ranks by, within the candidates), for a run of layers and a batch of requests at once.

The keys are gathered as whole blocks, one row per (layer, block, KV head), in one index op
over a flat view of the pool: the key copy's codes (int8 or int4) with their per-block
scales, or the host tier's float keys. The scoring is one compiled pass over the gathered keys
(codes are converted in registers, never dequantized into a float copy) that leaves only the
logits behind; the block scale multiplies the logits, not the keys. The copy is dim-major
([d, B] per block): per dim, one vector of a block's B tokens times each of the G query
heads' element, G accumulators over d, the form inductor vectorizes best (2.2x the pass over
[B, d] blocks, whose products reduce across a vector; the host tier's keys have that layout).
`select.rerank_by_mass` is the reference it matches (tests/kv/test_rerank.py). On the CPU the
codes are scored by a hand-written kernel instead (`kv/block_mass.py`, the same function at
about the memory's pace), where it builds; `candidate_mass_codes` stays its reference and
fallback."""

from __future__ import annotations

import torch

from oasiskv.compiled import compiled
from oasiskv.kv import block_mass
from oasiskv.kv.summaries import unpack_codes


def _fused_mass(pool: torch.Tensor, rows: torch.Tensor, block_scale: torch.Tensor,
                q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """pool [rows, B, d] a flat view of the keys (float keys or int8 codes), rows [..., c]
    each candidate's row in it, block_scale [..., c] (the code scale times the attention
    scale; for float keys the attention scale), q [..., G, d] (float32), real [..., c] False
    for a candidate past the request's blocks -> each candidate's share of q's softmax
    attention over the real candidates' keys, summed over its B tokens and the G query
    heads: [..., c], -inf where not real."""
    # fp32 products of bf16 keys: exact (select.rerank_by_mass's bf16 matmul rounds its
    # logits to bf16; inductor would not keep such a rounding anyway).
    # Compiled: the gather is fused into one pass over the candidates' keys (G products per
    # element, reduced over d, as head_log_probs), which leaves only the logits behind; a
    # gathered copy first (141 MB of int8 a step at SmolLM2's 7K x 6) costs more than the
    # scoring itself.
    keys = pool[rows]  # [..., c, B, d]
    logits = (keys.float()[..., None, :] * q[..., None, None, :, :]).sum(-1)  # [..., c, B, G]
    return _mass(logits, block_scale, real)


def _matmul_mass(pool: torch.Tensor, rows: torch.Tensor, block_scale: torch.Tensor,
                 q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """_fused_mass for eager PyTorch: the gathered keys times q as a matmul (unfused, the
    broadcast product above would be a [..., c, B, G, d] float32 temporary: GBs)."""
    logits = torch.matmul(pool[rows].float(), q.transpose(-1, -2)[..., None, :, :])
    return _mass(logits, block_scale, real)  # [..., c, B, G] above


def _mass(logits: torch.Tensor, block_scale: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    logits = logits * block_scale[..., None, None]
    lse = torch.logsumexp(logits, dim=-2)  # [..., c, G] each block's, per query head
    lse = lse.masked_fill(~real[..., None], float("-inf"))
    # per query head normalised over the candidates (as its softmax is), then summed
    mass = torch.exp(lse - torch.logsumexp(lse, dim=-2, keepdim=True)).sum(-1)  # [..., c]
    return mass.masked_fill(~real, float("-inf"))


def _token_logits(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """keys [..., c, d, b] (float), q [..., G, d] -> [..., c, G, b]: one product per query
    head (unrolled: inductor then keeps G accumulators in one loop over d, a vector over the
    block's tokens, each key vector converted once; as one broadcast product it converts G
    times and reduces across vectors: 1.8x slower)."""
    return torch.stack([(keys * q[..., None, g, :, None]).sum(-2)
                        for g in range(q.shape[-2])], -2)


def _fused_mass_codes(codes: torch.Tensor, rows: torch.Tensor, block_scale: torch.Tensor,
                      q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """_fused_mass over the key copy's dim-major codes [rows, d, B] (int8) or [rows, d, B/2]
    (4-bit pairs)."""
    c = codes[rows]  # [..., c, d, B or B/2]
    if c.dtype == torch.uint8:  # each nibble's logits apart: tokens j and j + B/2
        c = c.to(torch.int32)
        logits = torch.cat([_token_logits(((c & 15) - 8).float(), q),
                            _token_logits(((c >> 4) - 8).float(), q)], -1)
    else:
        logits = _token_logits(c.float(), q)  # [..., c, G, B]
    return _mass(logits.transpose(-1, -2), block_scale, real)


def _matmul_mass_codes(codes: torch.Tensor, rows: torch.Tensor, block_scale: torch.Tensor,
                       q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    logits = torch.matmul(q[..., None, :, :], unpack_codes(codes[rows]))  # [..., c, G, B]
    return _mass(logits.transpose(-1, -2), block_scale, real)


candidate_mass = compiled(_fused_mass, fallback=_matmul_mass)
candidate_mass_codes = compiled(_fused_mass_codes, fallback=_matmul_mass_codes)


def flat_blocks(keys: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """keys [layers, ids, Hkv, B, d] (or [..., d, B]) with each block's B*d elements
    contiguous (any strides above: a slice of a pool, a transposed view, an expanded one) ->
    the same storage as rows [rows, B, d] (no copy) and the row strides of (layer, id, head)."""
    _, _, _, B, d = keys.shape
    if keys.stride()[3:] != (d, 1):
        raise ValueError(f"a key block's elements must be contiguous, got strides "
                         f"{keys.stride()}")
    offset = keys.storage_offset()
    if any(s % (B * d) for s in (*keys.stride()[:3], offset)):
        raise ValueError("key blocks must start at multiples of B*d elements")
    rows = (keys.untyped_storage().nbytes() // keys.element_size() - offset) // (B * d)
    flat = keys.as_strided((rows, B, d), (B * d, d, 1), offset)
    return flat, tuple(s // (B * d) for s in keys.stride()[:3])


def rerank_layers(scores: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, c: int,
                  ids: torch.Tensor, keys: torch.Tensor,
                  key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [layers, R, Hkv, n] (-inf past a request's blocks) -> each KV head's best c
    blocks re-scored by their attention mass (`candidate_mass`), -inf elsewhere (c >= n:
    every block, read in block order; the scores only say which are real). q
    [layers, R, H, d]; scale [layers] the attention scales; ids [R, n] the requests' summary
    ids (where block i of request r lies in keys); keys: float keys [layers, ids, Hkv, B, d],
    or the key copy's codes [layers, ids, Hkv, d, B] (int8; 4-bit pairs: [..., d, B/2])
    with key_scales [layers, ids, Hkv]."""
    if c >= scores.shape[-1]:  # every block a candidate: the pool read in order, no top-c
        values, indices = scores, None
    else:
        values, indices = torch.topk(scores, c, dim=-1)  # [layers, R, Hkv, c]
    L, R, hkv, _ = values.shape
    pool, (layer_stride, id_stride, head_stride) = flat_blocks(keys)
    dev = keys.device
    chosen = ids.to(dev)[None, :, None, :].expand(L, R, hkv, -1)  # [layers, R, Hkv, n]
    if indices is not None:
        chosen = chosen.gather(-1, indices.to(dev))  # [layers, R, Hkv, c] summary ids
    j = torch.arange(L, device=dev)[:, None, None, None]
    h = torch.arange(hkv, device=dev)[None, None, :, None]
    rows = j * layer_stride + h * head_stride + chosen * id_stride
    qg = q.to(dev).reshape(L, R, hkv, -1, q.shape[-1])  # [layers, R, Hkv, G, d]
    block_scale = scale.to(dev, torch.float32)[:, None, None, None].expand(values.shape)
    if key_scales is not None:  # [layers, ids, Hkv]: laid out as the codes' blocks, a take
        # (4x faster than indexing by three tensors at 7K x 6: 0.75 -> 0.18 ms)
        same = key_scales.stride() == (layer_stride, id_stride, head_stride)
        block_scale = (torch.take(key_scales, rows) if same else key_scales[j, chosen, h]) \
            * block_scale
    args = (pool, rows, block_scale.contiguous(), qg.float().contiguous(),
            (values > float("-inf")).to(dev))
    if key_scales is None:
        mass = candidate_mass(*args)
    elif (ext := block_mass.serves(pool)) is not None:
        mass = block_mass.candidate_mass_codes(ext, *args)
    else:
        mass = candidate_mass_codes(*args)
    if indices is None:
        return mass.to(scores)  # in block order already, -inf where not real
    return torch.full_like(scores, float("-inf")).scatter_(-1, indices, mass.to(scores))


def warm_up_rerank(keys: torch.Tensor, num_heads: int) -> None:
    """Compiles `candidate_mass` for the shapes selections pass (one layer or a run, one
    request or several), or builds the CPU codes' kernel, so that no request's step waits for
    it. keys: a pool of the kind the rerank reads (codes [layers, ids, Hkv, d, B or B/2] or
    float keys [..., B, d]), as in a step taken in inference mode; a size of 1 is a guard of
    the compiled code, so both are passed. The candidates are as many as no other size
    (dynamo gives equal sizes one symbol, and the query group's size is specialized: a count
    of candidates equal to it would be too, and each request shorter than c*K blocks would
    compile anew)."""
    L, _, hkv = keys.shape[:3]
    codes = not keys.is_floating_point()
    d = keys.shape[-2] if codes else keys.shape[-1]
    c = max(num_heads, hkv, L, d, *keys.shape[3:]) + 1  # equal to no other size
    n = c + 1  # blocks per request
    pool = torch.zeros(L, 2 * n, *keys.shape[2:], dtype=keys.dtype, device=keys.device)
    kscales = torch.ones(L, 2 * n, hkv, device=keys.device) if codes else None
    with torch.inference_mode():
        for layers in sorted({1, L}):
            for requests in (1, 2):
                ids = torch.arange(requests * n).view(requests, n)
                scores = torch.randn(layers, requests, hkv, n)
                q = torch.zeros(layers, requests, num_heads, d, device=keys.device)
                rerank_layers(scores, q, torch.ones(layers), c, ids, pool[:layers],
                              None if kscales is None else kscales[:layers])
