"""`oasiskv generate | serve | bench decode | eval recall | train-drafter`: the command line
over the same config as `LLM(...)`."""

# Each subcommand is a module that owns its flags beside its run: `COMMANDS` (its name(s) ->
# help; `eval passkey|needle|ppl|all` share one module), `add_arguments(parser)` and
# `run(args) -> exit status`, where `args.subcommand` is the name it was called by. This
# module only assembles them (REGISTRY) and reports bad input as one line on stderr with exit
# status 2.

from __future__ import annotations

import argparse
import logging
import sys
from types import ModuleType

from oasiskv.bench import decode, pareto, pipeline, throughput
from oasiskv.bench import pd as bench_pd
from oasiskv.bench import serve as bench_serve
from oasiskv.cli_input import Parser
from oasiskv.commands import generate, pd, train_drafter
from oasiskv.eval import fidelity, recall_cli, ruler
from oasiskv.serve import router_cli, server

Group = tuple[str, str, list[ModuleType]]  # a command over subcommands: (name, help, modules)

# in the order `oasiskv --help` lists them
REGISTRY: list[ModuleType | Group] = [
    generate, pd, server, router_cli,
    ("bench", "benchmarks", [decode, pipeline, throughput, pareto, bench_serve, bench_pd]),
    ("eval", "measuring tools", [recall_cli, fidelity, ruler]),
    train_drafter,
]


def registered() -> list[ModuleType]:
    """Every subcommand module of the registry, the groups' included."""
    return [m for e in REGISTRY for m in (e[2] if isinstance(e, tuple) else [e])]


def _add(subparsers: argparse._SubParsersAction, module: ModuleType) -> None:
    for name, help_ in module.COMMANDS.items():
        p = subparsers.add_parser(name, help=help_)
        module.add_arguments(p)
        p.set_defaults(func=module.run, subcommand=name)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="oasiskv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for entry in REGISTRY:
        if isinstance(entry, tuple):
            name, help_, modules = entry
            group = sub.add_parser(name, help=help_).add_subparsers(dest=name, required=True)
            for module in modules:
                _add(group, module)
        else:
            _add(sub, entry)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"oasiskv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
