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
