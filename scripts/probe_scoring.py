"""The attention mass each block scoring misses at K blocks per KV head (issue 41's ablation),
from SmolLM2's true queries on real text: which second stage, at which precision, is worth
its bytes and its work. Offline, one forward per prompt, no engine.

  python scripts/probe_scoring.py [--prompts 3] [--context 7168] [--top-k 128] [--json F]

Per Austen prompt (`eval.recall.austen_prompts`), HF transformers in float32 computes every
layer's post-RoPE queries and keys (`apply_rotary_pos_emb` hooked); the last 64 positions,
every 4th, are the probes. A probe attends to the complete blocks before the probes (the
candidates) and to the tokens after them (always held: the active region). Each scoring picks
K blocks per KV head; the table gives the softmax mass (mean over query heads) outside its
blocks and the active region, averaged over probes, KV heads, layers and prompts: `oracle`
(the true top-K by mass) is the floor, `quest` (the min/max bound summed over the group: the
engine with rerank=0) the ceiling to beat. The second stages re-rank the best c*K by the
bound by their log-sum-exp mass, as `kv/rerank.py` does, from: the float keys, the int8 or
int4 copy (a scale per block and KV head, as `kv/summaries.quantize_keys`), the r dims of
largest |q| summed over the group (SparQ's approximation, the dims shared by the group), or a
rank-r PCA of the prompt's own keys (Loki's). bytes/token: what the copy adds per token, KV
head and layer. The engine predicts with the draft token's query instead (lookahead):
`oasiskv eval recall` measures that part. Prompts' q/k are cached in --cache-dir."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

B = 16
PROBES = 64  # the last positions probe, every 4th


@functools.cache
def hf_model(model: str):  # noqa: ANN201
    from oasiskv.bench.peers import load_hf

    return load_hf(model, torch.float32)


def capture(model: str, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (q [H, PROBES, d] of the last positions, k [Hkv, T, d]), post-RoPE, fp32."""
    import transformers.models.llama.modeling_llama as llama

    hf, out, rope = hf_model(model), [], llama.apply_rotary_pos_emb

    def hooked(q, k, cos, sin, *args, **kwargs):  # noqa: ANN001, ANN202
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        out.append((q[0, :, -PROBES:].clone(), k[0].clone()))
        return q, k

    llama.apply_rotary_pos_emb = hooked
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]), use_cache=False)
    finally:
        llama.apply_rotary_pos_emb = rope
    return out


def quantized(kc: torch.Tensor, bits: int) -> torch.Tensor:
    """kc [Hkv, n, B, d] -> the copy's keys, a scale per block and head (as quantize_keys)."""
    top = 2 ** (bits - 1) - 1
    scale = (kc.abs().amax((-2, -1), keepdim=True) / top).clamp_min(1e-30)
    return (kc / scale).round().clamp(-top, top) * scale


def missed(q: torch.Tensor, k: torch.Tensor, K: int) -> dict[str, float]:
    """One layer: q [H, PROBES, d], k [Hkv, T, d] -> each scoring's missed mass."""
    H, hkv, d = q.shape[0], k.shape[0], q.shape[-1]
    G, T, scale = H // hkv, k.shape[1], d ** -0.5
    first = T - PROBES  # probes at first..T-1; candidates: the complete blocks before them
    n = first // B
    probes = torch.arange(0, PROBES, 4)
    qp = q[:, probes].view(hkv, G, len(probes), d)  # [Hkv, G, P, d]
    logits = torch.einsum("hgpd,htd->hgpt", qp, k) * scale
    future = torch.arange(T)[None, :] > (first + probes)[:, None]  # causal: [P, T]
    prob = logits.masked_fill(future, float("-inf")).softmax(-1)
    mass = prob[..., :n * B].unflatten(-1, (n, B)).sum(-1).mean(1)  # [Hkv, P, n]
    held = prob[..., n * B:].sum(-1).mean(1)  # the active region's: [Hkv, P]

    def miss(sel: torch.Tensor) -> float:  # [Hkv, P, K] block indices
        return (1 - held - mass.gather(-1, sel).sum(-1)).mean().item()

    kc = k[:, :n * B].view(hkv, n, B, d)
    lo, hi = kc.amin(2), kc.amax(2)  # [Hkv, n, d]
    e = qp[..., None, :]
    quest = torch.maximum(e * lo[:, None, None], e * hi[:, None, None]).sum((-1, 1))  # [Hkv,P,n]

    def rerank(keys: torch.Tensor, c: float = 2, qr: torch.Tensor = qp) -> float:
        """keys [Hkv, P or 1, n, B, r] against qr [Hkv, G, P, r]."""
        cand = quest.topk(min(n, int(c * K)), -1).indices  # [Hkv, P, cK]
        lse = torch.logsumexp(torch.einsum("hgpr,hpnbr->hgpnb", qr, keys) * scale, -1)
        lse = lse.gather(-1, cand[:, None].expand(-1, G, -1, -1))
        m = (lse - torch.logsumexp(lse, -1, keepdim=True)).exp().sum(1)
        return miss(cand.gather(-1, m.topk(K, -1).indices))

    full = kc[:, None]  # [Hkv, 1, n, B, d]
    out = {"oracle": miss(mass.topk(K, -1).indices),
           "quest (rerank=0)": miss(quest.topk(K, -1).indices)}
    for c in (1.5, 2, 3):
        out[f"rerank c={c:g}, float keys"] = rerank(full, c)
    for bits in (8, 4):
        out[f"rerank c=2, int{bits} copy"] = rerank(quantized(kc, bits)[:, None])
    for r in (16, 32):  # SparQ: the group's r dims of largest summed |q|
        dims = qp.abs().sum(1).topk(r, -1).indices  # [Hkv, P, r]
        keys = kc[:, None].expand(-1, len(probes), -1, -1, -1).gather(
            -1, dims[:, :, None, None, :].expand(-1, -1, n, B, -1))
        out[f"rerank c=2, {r} of {d} dims"] = rerank(
            keys, qr=qp.gather(-1, dims[:, None].expand(-1, G, -1, -1)))
    _, vecs = torch.linalg.eigh(kc.flatten(1, 2).transpose(1, 2) @ kc.flatten(1, 2))
    for r in (16, 32):  # Loki: the prompt's own keys' top-r principal directions
        P = vecs[..., -r:]  # [Hkv, d, r]
        out[f"rerank c=2, rank-{r} PCA"] = rerank(torch.einsum("hnbd,hdr->hnbr", kc, P)[:, None],
                                                  qr=torch.einsum("hgpd,hdr->hgpr", qp, P))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--context", type=int, default=7168)
    ap.add_argument("--top-k", type=int, default=128)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache/oasiskv/probe-qk"))
    ap.add_argument("--json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from oasiskv.eval.recall import austen_prompts
    from oasiskv.models.registry import resolve_model

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    totals: dict[str, list[float]] = {}
    for p in austen_prompts(tok, args.prompts, args.context):
        f = Path(args.cache_dir) / f"{args.model}-{p['name']}-{p['offset']}-{args.context}.pt"
        if not f.exists():
            f.parent.mkdir(parents=True, exist_ok=True)
            torch.save(capture(args.model, p["ids"]), f)
        for q, k in torch.load(f):
            for name, v in missed(q, k, args.top_k).items():
                totals.setdefault(name, []).append(v)
    rows = [{"scoring": name, "missed_mass": sum(v) / len(v)} for name, v in totals.items()]
    floor, ceiling = rows[0]["missed_mass"], rows[1]["missed_mass"]
    print(f"| scoring (K={args.top_k}, {args.context} tokens, {args.prompts} prompts) | "
          "missed mass | share of quest's excess closed |\n|---|---|---|")
    for r in rows:
        r["gap_closed"] = (ceiling - r["missed_mass"]) / (ceiling - floor)
        print(f"| {r['scoring']} | {r['missed_mass']:.4f} | {r['gap_closed']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
