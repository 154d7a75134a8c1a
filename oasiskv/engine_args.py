"""The engine's flags and the mapping from parsed flags to `LLM(**kwargs)`: one flag per config
field, typed and documented by the field itself (`EngineConfig.flat_fields`), so the command
line, the server and the benchmarks share one spelling with the Python API."""

from __future__ import annotations

import argparse
import dataclasses

from oasiskv.config import EngineConfig


def flag_type(annotation: str | type) -> type:
    """The type a flag (or a KEY=VAL option) of a config field with this annotation parses
    its text with."""
    # Fields are annotated like "int | None" (postponed annotations).
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    names = [n.strip() for n in text.split("|")]
    if "str" in names:  # e.g. `int | str` sizes like 512MiB: the dataclass parses the text
        return str
    return {"int": int, "float": float, "bool": parse_bool}.get(names[0], str)


def parse_bool(text: str) -> bool:
    if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    return text.lower() in ("1", "true", "yes", "on")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field (`--max-num-seqs` for `max_num_seqs`), defaults from the
    dataclasses, so the CLI and `LLM(**kwargs)` never drift apart."""
    group = parser.add_argument_group("engine")
    for _, f in EngineConfig.flat_fields():
        default = None if f.default is dataclasses.MISSING else f.default
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                           type=flag_type(f.type), default=argparse.SUPPRESS,
                           help=f"{f.metadata.get('help', '')} (default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags the user gave (unset ones are absent: the dataclass defaults apply)."""
    names = {f.name for _, f in EngineConfig.flat_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """`--device` for a command that builds its engines from its own flags (the benches, the
    evals, train-drafter): the config field's spelling, default and help, so that every
    engine of the run and any peer it compares with (HF transformers) use that device."""
    field = next(f for _, f in EngineConfig.flat_fields() if f.name == "device")
    parser.add_argument("--device", default=field.default,
                        help=f"{field.metadata.get('help', '')}; every engine of the run and "
                        f"its HF peers run there (default: {field.default})")
