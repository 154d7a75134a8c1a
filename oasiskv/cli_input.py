"""What the command line reads from its user, refused the way all bad input is (one line on
stderr, exit status 2): its arguments and the prompt."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """Usage mistakes (an unknown flag, a value that does not parse) as one line on stderr and
    exit status 2, as every other bad input is; subcommands inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"oasiskv: error: {message} (see: {self.prog} --help)\n")


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


def read_prompt(args: argparse.Namespace) -> str:
    """--prompt TEXT, or the contents of --prompt-file: UTF-8 text, not empty."""
    if not args.prompt_file:
        if args.prompt is None:
            raise ValueError("give --prompt TEXT or --prompt-file FILE")
        return args.prompt
    path = Path(args.prompt_file)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"--prompt-file {path}: cannot read it ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None
    if not text:
        raise ValueError(f"--prompt-file {path} is empty")
    return text
