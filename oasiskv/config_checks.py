"""Checks every config dataclass shares: values of their fields' annotated types, finite
floats, byte sizes read from text, and a device this machine has.

A wrongly typed value is refused, not coerced (`top_k="32"`, `max_num_seqs=2.5`,
`prefault_kv=1`). The command line parses numbers from text before they get here
(`engine_args.flag_type` derives each flag's type from the same annotations), so only the Python API
can hand in a wrong type. Fields annotated with `str` beside a number (byte budgets,
`f_hbm="auto"`) keep taking text, which their own `__post_init__` parses.
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
    its annotation, and ValueError for a NaN or infinite float. Fields whose metadata has
    `path=True` also take an `os.PathLike` (kept as its text). Annotations other than unions
    of int, float, str, bool and None (nested dataclasses) are not checked here."""
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
        if isinstance(value, float) and not math.isfinite(value):
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
        raise ValueError(f"device {str(device)!r}: torch has no {device.type} device here "
                         f"(torch {torch.__version__}); use device='cpu'")
    if device.index is not None and device.index >= count:
        raise ValueError(f"device {str(device)!r}: this machine has {count} {device.type} "
                         f"device(s), indices 0 to {count - 1}")
