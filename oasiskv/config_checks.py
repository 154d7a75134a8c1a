"""Checks every config dataclass shares: values of their fields' annotated types, finite
floats, byte sizes read from text, and a device this machine has; and CacheConfig's own rules
(`check_cache`), with the values its fields take.

A wrongly typed value is refused, not coerced (`top_k="32"`, `max_num_seqs=2.5`,
`prefault_kv=1`). The command line parses numbers from text before they get here
(`engine_args.flag_type` derives each flag's type from the same annotations), so only the
Python API can hand in a wrong type. Fields annotated with `str` beside a number (byte
budgets, `f_hbm="auto"`) keep taking text, which their own `__post_init__` parses.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Any

import torch


class FieldTypeError(ValueError, TypeError):
    """A config value of the wrong type (a ValueError, as all bad input is, and a TypeError)."""


def _fits(value: Any, kind: str) -> bool:
    if kind == "None":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # bool is an int subclass, but True is no block count
        return False
    if kind == "int":
        return isinstance(value, numbers.Integral)
    if kind == "float":  # an int is an exact float (f_host=1): taking it loses nothing
        return isinstance(value, numbers.Real)
    return isinstance(value, str)


_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "True or False",
          "None": "None"}


def check_field_types(obj: Any) -> None:
    """Raises FieldTypeError naming the first field of dataclass `obj` whose value does not fit
    its annotation, and ValueError for a NaN or infinite float (+inf passes where the
    metadata has `inf=True`). Fields whose metadata has `path=True` also take an
    `os.PathLike` (kept as its text). Annotations other than unions of int, float, str, bool
    and None (nested dataclasses) are not checked here."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("path") and isinstance(value, os.PathLike):
            value = os.fspath(value)
            setattr(obj, f.name, value)
        kinds = [k.strip() for k in str(f.type).split("|")]
        if not all(k in _WORDS for k in kinds):
            continue
        if not any(_fits(value, k) for k in kinds):
            want = " or ".join(_WORDS[k] for k in kinds)
            raise FieldTypeError(f"{f.name} must be {want}, got {value!r} "
                                 f"({type(value).__name__})")
        if (isinstance(value, float) and not math.isfinite(value)
                and not (f.metadata.get("inf") and value == math.inf)):
            raise ValueError(f"{f.name} must be a finite number, got {value}")


_BYTE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """'2GiB' -> 2147483648; plain numbers are bytes."""
    if isinstance(value, int | float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"cannot read {value!r} as a size in bytes (examples: 512MiB, 2GiB, 1e9)")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def parse_budget(name: str, value: int | str) -> int:
    """parse_bytes, with the field's name in its error."""
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def check_device_present(device: torch.device) -> None:
    """A device torch can name but this machine lacks (cuda without CUDA) fails at config time,
    not at the first tensor put there."""
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)
    available = backend is not None and hasattr(backend, "is_available") and \
        backend.is_available()
    count = backend.device_count() if available else 0
    if count == 0:
        # a CPU-only wheel (torch 2.x+cpu) cannot use a GPU even where one is installed
        built = device.type != "cuda" or torch.backends.cuda.is_built()
        why = (f"this machine has no {device.type} device" if built
               else "this torch build has no CUDA (a CPU-only wheel)")
        raise ValueError(f"device {str(device)!r}: {why} (torch {torch.__version__}); "
                         "use device='cpu'")
    if device.index is not None and device.index >= count:
        raise ValueError(f"device {str(device)!r}: this machine has {count} {device.type} "
                         f"device(s), indices 0 to {count - 1}")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16}
KV_MODES = ("dense", "sparse")
PREDICTORS = ("lookahead", "previous", "exact", "oracle")
RERANK_SOURCES = ("host", "int8", "int4")
SCORE_AGGREGATIONS = ("sum", "softmax-sum", "softmax-max")
HANDOFF_SUMMARIES = ("exact", "int8")
PREFETCH = ("async", "sync")
_REMOTE = re.compile(r"mooncake://[^\s:/]+:[0-9]{1,5}|inprocess://[A-Za-z0-9_.-]+")


def check_cache(c: Any) -> None:
    """A CacheConfig's rules, each broken one a ValueError naming the field; parses the byte
    budgets and a numeric f_hbm in place."""
    if c.block_size <= 0 or c.block_size & (c.block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {c.block_size}")
    c.device_kv_budget = parse_budget("device_kv_budget", c.device_kv_budget)
    if c.device_kv_budget <= 0:
        raise ValueError(f"device_kv_budget must be positive, got {c.device_kv_budget}")
    c.host_kv_budget = parse_budget("host_kv_budget", c.host_kv_budget)
    if c.host_kv_budget <= 0:
        raise ValueError(f"host_kv_budget must be positive, got {c.host_kv_budget}")
    if c.kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode must be one of {KV_MODES}, got {c.kv_mode!r}")
    if c.predictor not in PREDICTORS:
        raise ValueError(f"predictor must be one of {PREDICTORS}, got {c.predictor!r}")
    if c.top_k <= 0:
        raise ValueError(f"top_k must be a positive number of blocks, got {c.top_k}")
    if c.f_hbm != "auto":
        try:
            c.f_hbm = float(c.f_hbm)
        except ValueError:
            raise ValueError(f"f_hbm must be a fraction in (0, 1] or auto, "
                             f"got {c.f_hbm!r}") from None
        if not 0 < c.f_hbm <= 1:
            raise ValueError(f"f_hbm must be in (0, 1] or auto, got {c.f_hbm}")
    if c.prefetch not in PREFETCH:
        raise ValueError(f"prefetch must be one of {PREFETCH}, got {c.prefetch!r}")
    if c.prefetch_group < 0:
        raise ValueError(f"prefetch_group must be >= 0 (0: half the layers), "
                         f"got {c.prefetch_group}")
    for name in ("sink_blocks", "recent_blocks"):
        if getattr(c, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(c, name)}")
    if c.sink_blocks + c.recent_blocks >= c.top_k:
        raise ValueError(f"sink_blocks + recent_blocks ({c.sink_blocks} + "
                         f"{c.recent_blocks}) must leave room in top_k ({c.top_k}) "
                         "for selected blocks")
    if c.dense_layers < 0:
        raise ValueError(f"dense_layers must be >= 0 (0: every layer sparse), "
                         f"got {c.dense_layers}")
    if c.summary_dtype != "auto" and c.summary_dtype not in DTYPES:
        raise ValueError(f"summary_dtype {c.summary_dtype!r} is not auto or one of "
                         f"{sorted(set(DTYPES))}")
    if c.handoff_summaries not in HANDOFF_SUMMARIES:
        raise ValueError(f"handoff_summaries must be one of {HANDOFF_SUMMARIES}, "
                         f"got {c.handoff_summaries!r}")
    if c.score_alpha < 0:
        raise ValueError(f"score_alpha must be >= 0, got {c.score_alpha}")
    if c.score_aggregation not in SCORE_AGGREGATIONS:
        raise ValueError(f"score_aggregation must be one of {SCORE_AGGREGATIONS}, "
                         f"got {c.score_aggregation!r}")
    if c.score_aggregation != "sum" and c.predictor == "oracle":
        raise ValueError("score_aggregation combines summary scores; predictor=oracle has "
                         "none (it ranks every block by attention already)")
    s = c.summary_splits
    if s < 1 or s & (s - 1) or s > c.block_size:
        raise ValueError(f"summary_splits must be a power of two from 1 to block_size "
                         f"({c.block_size}), got {s}")
    if s > 1 and c.predictor == "oracle":
        raise ValueError("summary_splits refines the block summaries; predictor=oracle has "
                         "none (it ranks every block by attention already)")
    if c.rerank != 0 and not c.rerank >= 1:
        raise ValueError(f"rerank must be 0 (off) or >= 1 (candidates per top_k block), "
                         f"got {c.rerank}")
    if c.rerank_source not in RERANK_SOURCES:
        raise ValueError(f"rerank_source must be one of {RERANK_SOURCES}, "
                         f"got {c.rerank_source!r}")
    if c.rerank_source == "int4" and c.block_size % 2:
        raise ValueError(f"rerank_source='int4' packs two tokens' codes a byte: block_size "
                         f"must be even, got {c.block_size}")
    _check_remote(c)


def _check_remote(c: Any) -> None:
    spec = c.remote_store
    if spec not in ("none", "inprocess") and not _REMOTE.fullmatch(spec):
        raise ValueError(f"remote_store must be none, inprocess, inprocess://NAME or "
                         f"mooncake://HOST:PORT, got {spec!r}")
    if spec != "none" and c.kv_mode != "sparse":
        raise ValueError(f"remote_store={spec!r} needs kv_mode=sparse (the remote tier "
                         "sits under the sparse mode's host tier)")
    if spec != "none" and c.predictor == "oracle":
        raise ValueError("predictor=oracle reads every key of the host tier, which holds "
                         f"only part of the history with remote_store={spec!r}")
    if spec != "none" and c.reranks and c.rerank_source == "host":
        raise ValueError("rerank_source=host reads the candidates' keys from the host tier, "
                         f"which holds only part of the history with remote_store={spec!r}: "
                         "use the device's key copy (rerank_source=int8 or int4)")
    if spec != "none" and c.dense_layers:
        raise ValueError("dense_layers with remote_store is not supported yet (the dense "
                         "layers' device copy is indexed by host blocks, which a remote "
                         "store's host caches evict)")
    for name in ("remote_lend", "prefix_cache_bytes"):
        if parse_budget(name, getattr(c, name)) < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {getattr(c, name)!r}")
    if not 0 < c.f_host <= 1:
        raise ValueError(f"f_host must be in (0, 1], got {c.f_host}")
    if c.f_host < 1 and spec == "none":
        raise ValueError(f"f_host={c.f_host} < 1 needs a remote store to fetch evicted "
                         "blocks from: set remote_store (inprocess or mooncake://HOST:PORT)")
