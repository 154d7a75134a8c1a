"""What every benchmark shares: prompts from real text and their prefilled K/V, greedy
agreement (tables, JSON and plots: `oasiskv/report.py`)."""

from __future__ import annotations

import hashlib
import logging
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from oasiskv.config import CacheConfig
from oasiskv.models.random_model import is_random, random_note
from oasiskv.models.registry import resolve_model

log = logging.getLogger(__name__)


def print_model_note(model: str) -> None:
    """The header line of a bench run on a `random:` model: its tokens are meaningless."""
    note = random_note(model)
    if note:
        print(f"> NOTE: {note}\n", flush=True)


def summary_label(summary_dtype: str, dtype: str) -> str:
    """The summaries' dtype as asked and, for auto, as an engine with `dtype` K/V keeps them:
    "auto (bfloat16)"."""
    kept = CacheConfig(summary_dtype=summary_dtype).summary_torch_dtype(getattr(torch, dtype))
    name = str(kept).removeprefix("torch.")
    return name if name == summary_dtype else f"{summary_dtype} ({name})"


def long_text() -> tuple[str, str]:
    """Real prose for prompts: the Austen novels when the Debian package is there, otherwise a
    deterministic shuffled-word text (said so in the output)."""
    try:
        from oasiskv.data.austen import austen_corpus

        return austen_corpus(), "austen"
    except FileNotFoundError as e:
        log.warning("%s; using synthetic text", e)
        rng = random.Random(0)
        words = ("the of and to a in that was her it his she he not be as had with for you "
                 "which but said at have my all on by so this were they would very could "
                 "been been there their what Elizabeth Darcy Emma Anne Marianne letter ball "
                 "house walk fortune sister mother family morning evening").split()
        return " ".join(rng.choice(words) for _ in range(400_000)), "synthetic"


def unique_prompts(tokenizer, count: int, length: int,
                   seed: int = 0) -> tuple[list[list[int]], str]:
    """`count` prompts of exactly `length` tokens from disjoint places in the text (no shared
    prefixes, so no engine can reuse work between them)."""
    text, source = long_text()
    # a fixed pool of at least 64 prompt places: the first c prompts do not depend on count,
    # so runs with different concurrency levels share prompts (and cached prompt K/V)
    pool = max(count, 64)
    ids = tokenizer.encode(text[: (pool * length + length) * 8], add_special_tokens=False)
    if len(ids) < count * length:
        ids = ids * (count * length // max(len(ids), 1) + 1)
    rng = random.Random(seed)
    slots = list(range(len(ids) // length))
    rng.shuffle(slots)
    return [ids[s * length:(s + 1) * length] for s in slots[:count]], source


def prefix_kv_files(engine, prompts: list[list[int]], cache_dir: Path,
                    desc: str = "prefill", progress: bool = True) -> tuple[list[Path], float]:
    """Each prompt's K/V (all but its last token, `engine.compute_prefix_kv`) as a safetensors
    file under cache_dir, keyed by model, dtype and tokens: computed once, reused by later
    runs. Returns the files and the seconds spent computing the missing ones."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = engine.config.model  # a random: model is its name (no file)
    model = name if is_random(name) else str(resolve_model(name).resolve())
    files, seconds = [], 0.0
    for p in tqdm(prompts, desc=desc, unit="prompt", disable=not progress):
        key = hashlib.sha256(f"{model}|{engine.config.dtype}|".encode()
                             + torch.tensor(p[:-1]).numpy().tobytes()).hexdigest()[:32]
        path = cache_dir / f"{key}.safetensors"
        if not path.exists():
            t0 = time.perf_counter()
            tmp = path.with_suffix(".partial")  # an interrupted run leaves no half file
            save_file({"kv": engine.compute_prefix_kv(p[:-1])}, str(tmp))
            tmp.rename(path)
            seconds += time.perf_counter() - t0
        files.append(path)
    return files, seconds


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two sets of generated token lists agree."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=False)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


