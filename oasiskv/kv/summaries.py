"""Compressed keys: per block and KV head, the elementwise min and max of its post-RoPE keys
(with summary_splits = S, of each of its S sub-blocks of B/S tokens: S summary rows per block,
block b's at rows b*S .. b*S+S-1, so that S = 1 is one row per block)."""

from types import ModuleType

import torch

from oasiskv.compiled import compiled
from oasiskv.layers import decode_kernel

SOURCE = decode_kernel.SOURCE.with_name("quantize_keys.cpp")


def summarize(keys: torch.Tensor, splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [..., Hkv, n, B, d] (n whole blocks) -> kmin, kmax, each [..., n*splits, Hkv, d]:
    one row per B/splits-token sub-block, a block's in token order."""
    if splits > 1:  # [..., Hkv, n*splits, B/splits, d]: a view of contiguous keys
        keys = keys.unflatten(-2, (splits, -1)).flatten(-4, -3)
    return keys.amin(dim=-2).transpose(-3, -2), keys.amax(dim=-2).transpose(-3, -2)


def summary_rows(ids: torch.Tensor, splits: int) -> torch.Tensor:
    """Summary ids [n] -> their summary rows [n*splits] (each id's sub-blocks in order)."""
    if splits == 1:
        return ids
    return (ids[:, None] * splits + torch.arange(splits, device=ids.device)).flatten()


def round_outward(kmin: torch.Tensor, kmax: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """kmin, kmax in `dtype`, kmin rounded down and kmax up where `dtype` is coarser, so that
    the summary still bounds every key of its block (Quest's score stays an upper bound)."""
    lo, hi = kmin.to(dtype), kmax.to(dtype)
    if torch.finfo(dtype).eps <= torch.finfo(kmin.dtype).eps:
        return lo, hi
    # full_like, not new_tensor: a tensor from Python data would be a blocking copy on CUDA
    lo = torch.where(lo.to(kmin.dtype) > kmin,
                     torch.nextafter(lo, torch.full_like(lo, -torch.inf)), lo)
    hi = torch.where(hi.to(kmax.dtype) < kmax,
                     torch.nextafter(hi, torch.full_like(hi, torch.inf)), hi)
    return lo, hi


def quantize_bounds(kmin: torch.Tensor, kmax: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kmin, kmax [..., d] -> int8 codes lo, hi [..., d] and float32 scales [...] (one per
    summary row and KV head) such that dequantize_bounds(lo, hi, scales) bounds them outward:
    lo*s <= kmin and hi*s >= kmax elementwise, in float32 arithmetic (a hand-over's
    handoff_summaries=int8). The scale leaves one code of headroom for that correction."""
    lo32, hi32 = kmin.float(), kmax.float()
    top = torch.maximum(lo32.abs(), hi32.abs()).amax(dim=-1)  # [...]
    scales = (top / 126).clamp_min(torch.finfo(torch.float32).tiny)  # all-zero rows: codes 0
    s = scales[..., None]
    lo, hi = torch.floor(lo32 / s), torch.ceil(hi32 / s)
    lo = torch.where(lo * s > lo32, lo - 1, lo)  # the division rounded the wrong way
    hi = torch.where(hi * s < hi32, hi + 1, hi)
    return lo.to(torch.int8), hi.to(torch.int8), scales


def dequantize_bounds(lo: torch.Tensor, hi: torch.Tensor, scales: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_bounds' codes -> float32 kmin, kmax (round_outward takes them to a dtype)."""
    s = scales[..., None]
    return lo.float() * s, hi.float() * s


def quantize_keys(keys: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The rerank's low-bit key copy: keys [..., Hkv, n, B, d] -> codes [..., n, Hkv, d, B]
    (int8; with bits=4, uint8 [..., d, B/2]: two 4-bit codes a byte) and scales
    [..., n, Hkv] (float32), one scale per block and KV head: its largest |key| / (2^(bits-1)
    - 1), so that codes * scale is within scale / 2 of every key (rounded to nearest).
    A block's codes are dim-major (one row of its B tokens per dim), so that the rerank's
    scoring runs one vector over a block's tokens per dim (`kv.rerank`). 4-bit codes are
    stored +8 (1..15), token j in the low nibble of byte j and token j + B/2 in the high
    one: unpacked, the two nibbles of a row are its two halves in token order."""
    if bits not in (8, 4):
        raise ValueError(f"key copy bits must be 8 or 4, got {bits}")
    # a prompt's blocks in one fused pass (a 7K prompt's keys: 0.27 s eager, 0.05 s compiled,
    # which was most of the first token's wait); one block (a decode step's) eagerly, as a
    # size of 1 would compile a graph of its own
    return (_quantize_fused if keys.shape[-3] > 1 else _quantize)(keys, bits)


def _quantize(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = 2 ** (bits - 1) - 1
    keys = keys.float()
    scales = keys.abs().amax(dim=(-2, -1)) / top  # [..., Hkv, n]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block
    codes = torch.round(keys / safe[..., None, None]).clamp_(-top, top).transpose(-1, -2)
    if bits == 4:
        lo, hi = (codes + 8).to(torch.uint8).chunk(2, dim=-1)
        codes = lo | (hi << 4)
    else:
        codes = codes.to(torch.int8)
    return codes.transpose(-4, -3).contiguous(), scales.transpose(-2, -1)


_quantize_fused = compiled(_quantize)


def extension() -> ModuleType | None:
    """The int8 key copy's CPU kernel (`layers/csrc/quantize_keys.cpp`; None where it could
    not be built or loaded: warned once)."""
    return decode_kernel.load(SOURCE, "the key-copy kernel", "quantizing with PyTorch")


def quantize_into(keys: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  ids: torch.Tensor, layers: slice, bits: int) -> None:
    """quantize_keys(keys, bits) written into codes[layers, ids], scales[layers, ids]. On the
    CPU, 8 bits, by the kernel, read where the keys lie and written in place: the same codes,
    ~3x faster than the compiled pass and its copy into the rows (a batch of 7K prompts'
    admission step was mostly that pass); else quantize_keys."""
    d = keys.shape[-1]
    if (bits == 8 and keys.device.type == codes.device.type == "cpu"
            and keys.stride()[-2:] == (d, 1) and codes.is_contiguous()
            and scales.is_contiguous() and (ext := extension()) is not None):
        ext.quantize_into(keys, codes, scales, ids.contiguous(), layers.start or 0)
        return
    codes[layers, ids], scales[layers, ids] = quantize_keys(keys, bits)


def warm_up_key_copy(host_kv: torch.Tensor, block_size: int, bits: int) -> None:
    """Compiles the key copy's quantization for the keys a prefill passes, so that no
    request's first token waits for it: the host pool's keys read in place (host_kv
    [L, 2, Hkv, T, d]; a run of contiguous slots) and gathered (scattered slots), both in
    inference mode as a step runs. The block count is one no other size equals (dynamo
    gives equal sizes one symbol)."""
    L, _, hkv, T, d = host_kv.shape
    n = min(max(L, hkv, block_size, d) + 1, T // block_size)
    if n < 2:
        return
    with torch.inference_mode():
        keys = host_kv[:, 0, :, :n * block_size]  # [L, Hkv, n*B, d]
        for k in (keys, keys[:, :, torch.arange(n * block_size)]):
            quantize_keys(k.unflatten(2, (n, block_size)), bits)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., d, B] (int8) or [..., d, B/2] (uint8: 4-bit pairs) -> float32 codes
    [..., d, B]."""
    if codes.dtype == torch.uint8:
        return torch.cat([(codes & 15).float() - 8, (codes >> 4).float() - 8], dim=-1)
    return codes.float()


def dequantize_keys(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., d, B] (int8, or 4-bit pairs), scales [...] -> float32 keys [..., B, d]."""
    return unpack_codes(codes).transpose(-1, -2) * scales[..., None, None]
