"""`oasiskv serve` on the command line: every engine flag, and bad input as one line on
stderr with exit status 2 (before any model is loaded where it can be)."""

from __future__ import annotations

import re
import socket

import pytest

from oasiskv.cli import build_parser, main
from oasiskv.engine_args import engine_kwargs


def test_serve_flags_reach_the_options_and_the_engine(tiny_llama):
    args = build_parser().parse_args([
        "serve", "--model", str(tiny_llama), "--port", "0", "--api-key", "k",
        "--served-model-name", "tiny", "--max-waiting", "7", "--request-timeout", "2.5",
        "--max-body-bytes", "1MiB", "--max-num-seqs", "3", "--kv-mode", "sparse"])
    assert (args.port, args.api_key, args.served_model_name, args.max_waiting,
            args.request_timeout, args.max_body_bytes) == (0, "k", "tiny", 7, 2.5, "1MiB")
    assert args.host == "127.0.0.1"  # loopback unless told otherwise
    assert engine_kwargs(args) == {"model": str(tiny_llama), "max_num_seqs": 3,
                                   "kv_mode": "sparse"}


@pytest.mark.parametrize("argv, match", [
    (["--max-waiting", "0"], "--max-waiting must be at least 1"),
    (["--port", "70000"], r"--port must be in \[0, 65535\]"),
    (["--request-timeout", "-1"], "--request-timeout must be a positive number"),
    (["--max-body-bytes", "lots"], "size in bytes"),
    (["--api-key", ""], "--api-key is empty"),
    (["--model", "no-such-model-xyz", "--port", "0"], "unknown model"),
    (["--block-size", "12", "--port", "0"], "power of two"),
])
def test_bad_serve_input_exits_2_with_one_line(tiny_llama, capsys, argv, match):
    if "--model" not in argv:
        argv = ["--model", str(tiny_llama), *argv]
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"^oasiskv: error: .*{match}", err) and err.count("\n") == 1, err


def test_a_port_in_use_exits_2(tiny_llama, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tiny_llama), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
