"""The command line as a registry (`oasiskv/cli.py`): every subcommand module is registered,
each one's --help works, and each bench module reads only the flags it defines."""

import argparse
import ast
import importlib
import inspect
import pkgutil

import pytest

from oasiskv.cli import REGISTRY, build_parser, main, registered

# the commands the CLI had before it became a registry (the reference)
COMMANDS = {
    ("generate",), ("pd",), ("serve",), ("router",), ("train-drafter",),
    ("bench", "decode"), ("bench", "pipeline"), ("bench", "throughput"), ("bench", "pareto"),
    ("bench", "serve"), ("bench", "pd"),
    ("eval", "recall"), ("eval", "passkey"), ("eval", "needle"), ("eval", "ppl"),
    ("eval", "all"), ("eval", "ruler"),
}


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    out = {}
    for name, p in subparsers(build_parser()).items():
        if any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
            out.update({(name, sub): q for sub, q in subparsers(p).items()})
        else:
            out[(name,)] = p
    return out


def test_the_registry_builds_every_command_of_the_old_cli():
    assert set(commands()) == COMMANDS


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_subcommand_help_works(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: oasiskv {' '.join(command)} ") and "--help" in out


def command_modules() -> set:
    """Every module under these packages that defines a subcommand (imports them all)."""
    found = set()
    for package in ("bench", "eval", "commands", "serve"):
        pkg = importlib.import_module(f"oasiskv.{package}")
        for info in pkgutil.iter_modules(pkg.__path__):
            module = importlib.import_module(f"{pkg.__name__}.{info.name}")
            if hasattr(module, "COMMANDS") or hasattr(module, "add_arguments"):
                found.add(module)
    return found


def test_the_registry_covers_every_command_module():
    mods = registered()
    assert len(mods) == len(set(mods))  # none twice
    assert set(mods) == command_modules()
    for m in mods:  # the registry's protocol
        assert m.COMMANDS and all(isinstance(h, str) and h for h in m.COMMANDS.values())
        assert list(inspect.signature(m.add_arguments).parameters) == ["p"]
        assert list(inspect.signature(m.run).parameters) == ["args"]
    groups = [e for e in REGISTRY if isinstance(e, tuple)]
    assert [g[0] for g in groups] == ["bench", "eval"]
    assert all(m.__name__.startswith("oasiskv.bench.") for m in groups[0][2])


def args_read(module) -> set[str]:
    """The attributes the module's source reads off its parsed flags: `args.X`, `self.args.X`,
    and `a.X` in a function where `a = args` or `a = self.args`."""
    tree = ast.parse(inspect.getsource(module))

    def is_args(node: ast.expr) -> bool:
        return ((isinstance(node, ast.Name) and node.id == "args")
                or (isinstance(node, ast.Attribute) and node.attr == "args"))

    read = set()
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
        body = scope.body if scope is tree else [scope]
        nodes = [n for b in body for n in ast.walk(b)]
        if scope is tree:  # module level: outside the functions
            nodes = [n for b in body if not isinstance(b, (ast.FunctionDef, ast.ClassDef))
                     for n in ast.walk(b)]
        aliases = {t.id for n in nodes if isinstance(n, ast.Assign) and is_args(n.value)
                   for t in n.targets if isinstance(t, ast.Name)}
        read |= {n.attr for n in nodes if isinstance(n, ast.Attribute) and (
            is_args(n.value) or (isinstance(n.value, ast.Name) and n.value.id in aliases))}
    return read


def test_bench_modules_read_only_the_flags_they_define():
    parsers = commands()
    bench = importlib.import_module("oasiskv.bench")
    for info in pkgutil.iter_modules(bench.__path__):
        module = importlib.import_module(f"oasiskv.bench.{info.name}")
        defined = {"func", "subcommand", "command", "bench", "verbose"}
        for name in getattr(module, "COMMANDS", {}):
            defined |= {a.dest for a in parsers[("bench", name)]._actions}
        unknown = args_read(module) - defined
        assert not unknown, f"{module.__name__} reads args.{sorted(unknown)}"


# every command that builds engines: all but the router (it only relays to workers)
ENGINE_COMMANDS = sorted(COMMANDS - {("router",)})


def test_every_engine_command_takes_device_with_the_configs_default():
    from oasiskv.config import EngineConfig

    parsers = commands()
    for command in ENGINE_COMMANDS:
        device = [a for a in parsers[command]._actions if "--device" in a.option_strings]
        assert len(device) == 1, command
        if device[0].default is not argparse.SUPPRESS:  # engine flags: the dataclass's own
            assert device[0].default == EngineConfig().device == "cpu", command


@pytest.mark.parametrize("command", [c for c in ENGINE_COMMANDS if c[0] in ("bench", "eval",
                                                                          "train-drafter")
                                     and c != ("bench", "serve")], ids=" ".join)
def test_device_reaches_the_commands_engines(command, tiny_llama, monkeypatch, capsys,
                                             tmp_path):
    """`--device cuda` with torch told it has no CUDA: the command's first engine config
    refuses it (one line, exit 2), before any work; without the flag reaching the config the
    command would run on the CPU instead."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    extra = ["--out", str(tmp_path)] if command == ("train-drafter",) else []
    assert main([*command, *extra, "--model", str(tiny_llama), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oasiskv: error: device 'cuda': ") and err.count("\n") == 1, err


def test_bench_serve_starts_our_servers_on_its_device():
    from oasiskv.bench.serve import settings_of
    from oasiskv.bench.servers import parse_servers, server_command

    args = build_parser().parse_args(["bench", "serve", "--device", "cuda:1"])
    settings = settings_of(args)
    for spec in parse_servers("dense,sparse"):
        cmd = server_command(spec, settings, 8000)
        assert cmd[cmd.index("--device") + 1] == "cuda:1"
