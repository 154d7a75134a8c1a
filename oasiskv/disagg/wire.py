"""A hand-over between servers: its bytes go through the remote store, the control message
(JSON over HTTP) carries only keys, sizes and a few scalars.

`publish` packs the hand-over's tensors (token ids, summaries, the active block's K/V, working
sets, ages, kept block lists, sampler state) into one byte string, cut into store blocks under
the namespace `<request namespace>.meta`, and returns the descriptor: where the prompt blocks,
the slab and this blob are, and the blob's manifest (name, dtype, shape, offset of each
tensor). `fetch` reads the blob back into a `Handoff` and drops it from the store.

Times cross hosts as ages (seconds before the message was written), so the receiver rebases
them on its own clock (perf_counter is per process).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from oasiskv.kv.handoff import TRANSFERS, Handoff
from oasiskv.outputs import RequestOutput
from oasiskv.sequence import RequestMetrics
from oasiskv.store.remote_store import BlockKey, RemoteStore, RemoteStoreError

META = ".meta"
_TIMES = ("arrival_time", "first_scheduled_time", "first_token_time", "finish_time")


def metrics_to_json(m: RequestMetrics) -> dict:
    now, out = time.perf_counter(), dataclasses.asdict(m)
    for name in _TIMES:
        out[name] = None if out[name] is None else now - out[name]  # an age
    return out


def metrics_from_json(d: dict) -> RequestMetrics:
    now, d = time.perf_counter(), dict(d)
    for name in _TIMES:
        d[name] = None if d[name] is None else now - d[name]
    return RequestMetrics(**d)


def output_to_json(out: RequestOutput) -> dict:
    """A finished output that needs no hand-over (it ended on the prefill worker)."""
    d = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)
         if f.name not in ("metrics", "handoff", "prompt")}
    return {**d, "metrics": metrics_to_json(out.metrics)}


def output_from_json(d: dict) -> RequestOutput:
    return RequestOutput(**{**d, "prompt": None, "metrics": metrics_from_json(d["metrics"])})


def _tensors(h: Handoff) -> dict[str, torch.Tensor]:
    kept = [k.long() for k in h.kept]
    out = {"token_ids": torch.tensor(h.token_ids, dtype=torch.int64), "kmin": h.kmin,
           "kmax": h.kmax, "tail": h.tail, "head_map": h.head_map, "ages": h.ages,
           "kept": torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long),
           "kept_lens": torch.tensor([len(k) for k in kept], dtype=torch.int64)}
    optional = {"generator_state": h.generator_state, "key_codes": h.key_codes,
                "key_scales": h.key_scales, "summary_scales": h.summary_scales}
    return out | {k: t for k, t in optional.items() if t is not None}


def meta_namespace(namespace: str) -> str:
    return namespace + META


def namespaces(desc: dict) -> list[str]:
    """Everything a published hand-over holds in the store (to drop it when nobody takes it)."""
    out = [desc["namespace"], meta_namespace(desc["namespace"])]
    return out + ([desc["slab_namespace"]] if desc.get("slab_namespace") else [])


def publish(store: RemoteStore, h: Handoff) -> dict:
    """Puts the hand-over's tensors to the store; returns its descriptor (JSON-able). Raises
    RemoteStoreError when the put fails (then nothing of the blob stays)."""
    manifest, parts, offset = [], [], 0
    for name, t in _tensors(h).items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        manifest.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                         "shape": list(t.shape), "offset": offset, "nbytes": raw.numel()})
        parts.append(raw)
        offset += raw.numel()
    n = max(1, -(-offset // store.block_bytes))
    buf = torch.zeros(n * store.block_bytes, dtype=torch.uint8)
    buf[:offset] = torch.cat(parts)
    meta = meta_namespace(h.namespace)
    try:  # [n, 2, Hkv, B, d] in the store's dtype: the blob as blocks
        store.put_blocks([BlockKey(meta, 0, i) for i in range(n)],
                         buf.view(store.dtype).view(n, *store.block_shape))
    except RemoteStoreError:
        _remove(store, meta)
        raise
    return {"request_id": h.request_id, "namespace": h.namespace,
            "slab_namespace": h.slab_namespace, "transfer": h.transfer,
            "meta": {"namespace": meta, "blocks": n, "bytes": offset, "tensors": manifest},
            "num_prompt_tokens": h.num_prompt_tokens,
            "num_computed_tokens": h.num_computed_tokens, "seeded": list(h.seeded),
            "primed": list(h.primed), "draft_tokens": list(h.draft_tokens),
            "draft_weights": h.draft_weights, "metrics": metrics_to_json(h.metrics),
            "block_size": h.block_size, "summary_splits": h.summary_splits,
            "admission_bytes": h.admission_bytes, "kept_blocks": h.kept_blocks}


def fetch(store: RemoteStore, desc: dict) -> Handoff:
    """Reads a published hand-over back and drops its blob from the store (the prompt blocks
    and the slab stay: the decode engine reads them at admission). Raises ValueError for a
    malformed descriptor, RemoteStoreError when the read fails."""
    try:
        meta, transfer = desc["meta"], desc["transfer"]
        keys = [BlockKey(meta["namespace"], 0, i) for i in range(int(meta["blocks"]))]
        manifest = {t["name"]: t for t in meta["tensors"]}
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed hand-over descriptor: {e!r}") from None
    if transfer not in TRANSFERS or not keys:
        raise ValueError(f"malformed hand-over descriptor: transfer {transfer!r}, "
                         f"{len(keys)} blob blocks")
    try:
        buf = store.get_blocks(keys).view(-1).view(torch.uint8)
    finally:  # read once: a failed read leaves nothing behind either
        _remove(store, meta["namespace"])

    def tensor(name: str) -> torch.Tensor:
        t = manifest[name]
        raw = buf[t["offset"]:t["offset"] + t["nbytes"]].clone()
        return raw.view(getattr(torch, t["dtype"])).view(t["shape"])

    kept = list(tensor("kept").split(tensor("kept_lens").tolist()))
    return Handoff(
        request_id=desc["request_id"], namespace=desc["namespace"], prompt=None,
        token_ids=tensor("token_ids").tolist(), num_prompt_tokens=desc["num_prompt_tokens"],
        num_computed_tokens=desc["num_computed_tokens"], transfer=transfer, kept=kept,
        slab_namespace=desc["slab_namespace"], kmin=tensor("kmin"), kmax=tensor("kmax"),
        tail=tensor("tail"), head_map=tensor("head_map"), ages=tensor("ages"),
        seeded=list(desc["seeded"]), primed=list(desc["primed"]),
        draft_tokens=list(desc["draft_tokens"]), draft_weights=desc["draft_weights"],
        generator_state=tensor("generator_state") if "generator_state" in manifest else None,
        key_codes=tensor("key_codes") if "key_codes" in manifest else None,
        key_scales=tensor("key_scales") if "key_scales" in manifest else None,
        summary_scales=tensor("summary_scales") if "summary_scales" in manifest else None,
        metrics=metrics_from_json(desc["metrics"]), block_size=desc["block_size"],
        summary_splits=desc["summary_splits"])


def drop(store: RemoteStore, names: list[str]) -> int:
    """Removes namespaces (best effort); returns how many blocks went."""
    return sum(_remove(store, n) for n in names)


def _remove(store: RemoteStore, namespace: str) -> int:
    try:
        return store.remove(namespace)
    except RemoteStoreError:
        return 0
