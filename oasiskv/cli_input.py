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


def add_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a command that runs one prompt (`generate`, `pd`): the prompt, how to wrap
    it and how long and how greedily to answer."""
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--prompt-file", help="file whose contents are the prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")


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
