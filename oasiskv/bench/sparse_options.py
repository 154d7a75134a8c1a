"""`--sparse KEY=VAL[,KEY=VAL...]`: one sparse configuration as CacheConfig fields, each value
parsed by its field's annotated type (as the engine flags are) and checked by CacheConfig
itself; `default` is the engine's default sparse configuration."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from oasiskv.config import CacheConfig
from oasiskv.engine_args import flag_type
from oasiskv.eval.settings import Setting

DEFAULT = "default"
# fields one configuration may not set: every configuration shares them
FIXED = {"kv_mode": "sparse in every --sparse configuration (dense always runs as the baseline)",
         "device_kv_budget": "set once for every configuration by --device-kv-budget"}
# CacheConfig fields that Setting names itself; the rest go to its `options`
NAMED = {f.name for f in dataclasses.fields(Setting)} - {"kv_mode", "forced_drafts", "options"}
_WORDS = {int: "an integer", float: "a number"}


def parse_sparse(text: str) -> dict[str, Any]:
    """"top_k=64,score_aggregation=softmax-sum" -> {"top_k": 64, "score_aggregation": ...},
    the values as CacheConfig keeps them (f_hbm a float, byte sizes in bytes)."""
    fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    opts: dict[str, Any] = {}
    for item in (x.strip() for x in str(text).split(",")):
        if item == DEFAULT:  # the engine's default: changes no field
            continue
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or not key:
            raise ValueError(f"--sparse {text!r}: {item!r} is not KEY=VAL (or {DEFAULT})")
        if key in FIXED:
            raise ValueError(f"--sparse {text!r}: {key} is {FIXED[key]}")
        if key not in fields:
            known = ", ".join(sorted(set(fields) - set(FIXED)))
            raise ValueError(f"--sparse {text!r}: unknown key {key!r}; the keys are CacheConfig "
                             f"fields: {known}")
        if key in opts:
            raise ValueError(f"--sparse {text!r}: {key} given twice")
        kind = flag_type(fields[key].type)
        try:
            opts[key] = kind(value)
        except (ValueError, argparse.ArgumentTypeError) as e:
            why = f"expected {_WORDS[kind]}, got {value!r}" if kind in _WORDS else str(e)
            raise ValueError(f"--sparse {text!r}: {key}: {why}") from None
    try:
        config = CacheConfig(kv_mode="sparse", **opts)
    except ValueError as e:
        raise ValueError(f"--sparse {text!r}: {e}") from None
    return {k: getattr(config, k) for k in opts}


def sparse_setting(opts: dict[str, Any]) -> Setting:
    """The fidelity Setting of one configuration: CacheConfig's defaults where `opts` is
    silent, its own fields by name, any other field in `options` (named `field=value`)."""
    named = {"predictor": CacheConfig.predictor, "top_k": CacheConfig.top_k,
             **{k: v for k, v in opts.items() if k in NAMED}}
    rest = tuple((k, v) for k, v in opts.items() if k not in NAMED)
    return Setting("sparse", **named, options=rest)


def parse_settings(specs: list[str] | None) -> list[Setting]:
    """dense, then one sparse Setting per --sparse (default: the engine's default one)."""
    settings = [Setting("dense")] + [sparse_setting(parse_sparse(s))
                                     for s in (specs or [DEFAULT])]
    names = [s.name for s in settings]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--sparse: the same configuration twice: {twice[0]!r}")
    return settings
