"""The drafter training's data: chunks of text, the target's features over them (aux-layer
outputs, greedy next tokens, held-out top log-probabilities) and its own continuations, cached
as safetensors shards under OUT/features so that an interrupted run resumes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from oasiskv.train.spec import TrainSpec

SAMPLE_TEMPERATURE = 0.7
TOP_LOGPROBS = 32  # held-out: enough of the T=0.7 distribution to score sampled drafts
OWN_TEMPERATURES = (0.0, SAMPLE_TEMPERATURE)  # own continuation i uses OWN_TEMPERATURES[i % 2]
GENERATE_BATCH = 32  # continuations generated together (one engine batch) and cached as one file


# ---- text -------------------------------------------------------------------------------------

def text_chunks(spec: TrainSpec, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(training chunks, held-out chunks) of `spec.chunk` token ids each. Training chunks are
    taken round-robin over the novels so that a small --tokens still sees all of them."""
    if spec.data != "austen":
        raise ValueError(f"unknown data {spec.data!r}; known: austen")
    from oasiskv.data.austen import NOVELS, austen_text

    if spec.heldout not in NOVELS:
        raise ValueError(f"held-out novel {spec.heldout!r} is not one of {NOVELS}")

    def chunks_of(novel: str) -> list[list[int]]:
        ids = tokenizer.encode(austen_text(novel), add_special_tokens=False)
        return [ids[i:i + spec.chunk] for i in range(0, len(ids) - spec.chunk + 1, spec.chunk)]

    per_novel = [chunks_of(n) for n in NOVELS if n != spec.heldout]
    train: list[list[int]] = []
    for group in zip(*per_novel, strict=False):
        train += group
    train += [c for chunks in per_novel for c in chunks[min(map(len, per_novel)):]]
    want = math.ceil(spec.tokens / spec.chunk)
    if len(train) < want:
        raise ValueError(f"--tokens {spec.tokens}: the training novels hold only "
                         f"{len(train) * spec.chunk} tokens")
    heldout = chunks_of(spec.heldout)[:math.ceil(spec.heldout_tokens / spec.chunk)]
    return train[:want], heldout


# ---- features ---------------------------------------------------------------------------------

@torch.inference_mode()
def target_features(engine, ids: list[int], aux_layers: tuple[int, ...],
                    heldout: bool) -> dict[str, torch.Tensor]:
    """One chunk through the target (dense, positions 0..n-1): per position its features,
    greedy next token and, for held-out chunks, top log-probs at T=0.7."""
    from oasiskv.sampling_params import SamplingParams

    seq = engine.make_sequence(ids, SamplingParams(max_tokens=1))
    try:
        out = engine.forward(seq, len(ids), list(range(len(ids))), aux_layers)
    finally:
        engine.free(seq)
    features = out.features[0]
    if not torch.isfinite(features).all() or features.abs().max() > 6e4:
        raise RuntimeError("target features overflow fp16; store them in fp32")
    row = {"tokens": torch.tensor(ids, dtype=torch.int32),
           "features": features.half(),  # [n, F]
           "greedy": out.logits.argmax(-1).int()}  # [n]
    if heldout:
        logp = torch.log_softmax(out.logits / SAMPLE_TEMPERATURE, dim=-1)
        top = logp.topk(TOP_LOGPROBS, dim=-1)
        row.update(top_ids=top.indices.int(), top_logp=top.values)
    return row


def collect(engine, spec: TrainSpec, name: str, chunks: list[list[int]],
            aux_layers: tuple[int, ...]) -> list[Path]:
    """Writes (or finds) the feature shards of `chunks`; returns their paths in order."""
    folder = spec.out / "features"
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"model": spec.model, "aux_layers": list(aux_layers), "chunk": spec.chunk,
            "heldout": spec.heldout, "shard_chunks": spec.shard_chunks,
            "self_prompt": spec.self_prompt}
    meta_file = folder / "meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()) != meta:
        raise ValueError(f"{folder} holds features of another setting "
                         f"({meta_file.read_text().strip()}); use another --out or remove it")
    meta_file.write_text(json.dumps(meta))
    paths = []
    groups = [chunks[i:i + spec.shard_chunks] for i in range(0, len(chunks), spec.shard_chunks)]
    bar = tqdm(total=len(chunks) * spec.chunk, desc=f"features {name}", unit="tok",
               disable=spec.quiet or None)
    for i, group in enumerate(groups):
        path = folder / f"{name}_{i:05d}.safetensors"
        if cached_tokens(path) != group:
            rows = [target_features(engine, ids, aux_layers, name.startswith("heldout"))
                    for ids in group]
            tmp = path.with_suffix(".tmp")
            save_file({k: torch.stack([r[k] for r in rows]).contiguous() for k in rows[0]},
                      str(tmp))
            tmp.replace(path)  # atomic: a shard is either whole or absent
        paths.append(path)
        bar.update(len(group) * spec.chunk)
    bar.close()
    return paths


def cached_tokens(path: Path) -> list[list[int]] | None:
    """The token ids a cached shard was made from (None when there is none): a shard of
    other text (another --tokens, --seed) is made again."""
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("tokens").tolist()


def load_shards(paths: list[Path]) -> dict[str, torch.Tensor]:
    shards = [load_file(str(p)) for p in paths]
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


def own_continuations(engine, spec: TrainSpec, name: str,
                      prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt continued by the target to `spec.chunk` tokens, prompt i at temperature
    OWN_TEMPERATURES[i % 2]. Cached per GENERATE_BATCH prompts under OUT/features (a run
    resumes); must follow `collect`, which checks that the folder matches the setting."""
    from oasiskv.sampling_params import SamplingParams

    folder = spec.out / "features"
    texts: list[list[int]] = []
    bar = tqdm(total=len(prompts) * spec.chunk, desc=f"own text {name}", unit="tok",
               disable=spec.quiet or None)
    for first in range(0, len(prompts), GENERATE_BATCH):
        group = prompts[first:first + GENERATE_BATCH]
        path = folder / f"{name}_text_{first // GENERATE_BATCH:05d}.safetensors"
        cached = cached_tokens(path)
        if cached is None or len(cached) != len(group) or any(
                t[:len(p)] != p for t, p in zip(cached, group, strict=True)):
            ids = [engine.add_request(p, SamplingParams(
                max_tokens=spec.chunk - len(p), temperature=OWN_TEMPERATURES[(first + i) % 2],
                seed=spec.seed * 1_000_003 + first + i, ignore_eos=True))
                for i, p in enumerate(group)]
            ended = {}
            while engine.has_unfinished():
                ended |= {o.request_id: o for o in engine.step() if o.finished}
            bad = [o for o in ended.values() if o.finish_reason != "length"]
            if bad:
                raise RuntimeError(f"a continuation ended with {bad[0].finish_reason}: "
                                   f"{bad[0].error}")
            tmp = path.with_suffix(".tmp")
            save_file({"tokens": torch.tensor([p + ended[r].token_ids for p, r in
                                                zip(group, ids, strict=True)],
                                               dtype=torch.int32)}, str(tmp))
            tmp.replace(path)
        texts += load_file(str(path))["tokens"].tolist()
        bar.update(len(group) * spec.chunk)
    bar.close()
    return texts
