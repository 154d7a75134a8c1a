"""The shared reporting helpers (`oasiskv/report.py`): tables, JSON files, list flags, plots,
the machine line; each against a hand-written expectation."""

import json
import platform
import re

import pytest
import torch

from oasiskv import report
from oasiskv.report import (
    machine,
    markdown_table,
    parse_f_hbms,
    parse_list,
    platform_name,
    pyplot,
    save_figure,
    save_json,
    write_json,
)


def cells(line: str) -> list[str]:
    """A markdown table row's cells, split at the pipes that are not escaped."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_every_row_has_one_cell_per_column_even_with_pipes_in_the_text():
    columns = [("name", "drafter"), ("x", "recall | right"), ("n", "steps")]
    rows = [{"name": "eagle:a|b", "x": 0.92741, "n": 48}, {"name": "resync", "x": None, "n": 3}]
    head, sep, *body = markdown_table(rows, columns).splitlines()
    assert cells(head) == ["drafter", "recall | right", "steps"]
    assert sep == "|---|---|---|"
    assert [cells(line) for line in body] == [["eagle:a|b", "0.927", "48"], ["resync", "", "3"]]


def test_large_floats_lose_their_decimals():
    assert markdown_table([{"x": 12345.6}], [("x", "x")]).splitlines()[-1] == "| 12346 |"


@pytest.mark.parametrize("text, kind, want", [
    ("4096,7168", int, [4096, 7168]), (" 1, 2,,", int, [1, 2]), ("0.5,1", float, [0.5, 1.0]),
    ("dense,sparse", str, ["dense", "sparse"]), (8, int, [8]), ("", int, []),
])
def test_parse_list(text, kind, want):
    assert parse_list(text, kind) == want


def test_parse_f_hbms_keeps_auto():
    assert parse_f_hbms("0.05,auto,1") == [0.05, "auto", 1.0]
    with pytest.raises(ValueError):
        parse_f_hbms("0.05,lots")


def test_write_json_writes_and_says_so(tmp_path, capsys):
    path = tmp_path / "out.json"
    write_json(str(path), {"a": 1, "p": tmp_path})
    assert json.loads(path.read_text()) == {"a": 1, "p": str(tmp_path)}
    assert capsys.readouterr().out == f"wrote {path}\n"
    write_json(None, {"a": 1})  # no path: nothing written, nothing said
    assert capsys.readouterr().out == ""


def test_save_json_replaces_the_file_whole(tmp_path, capsys, monkeypatch):
    path = tmp_path / "out.json"
    save_json(str(path), {"cells": [1]})
    assert json.loads(path.read_text()) == {"cells": [1]}
    assert capsys.readouterr().out == ""

    real = report.Path.write_text

    def crash(self, text, *args, **kwargs):  # the disk fills halfway through the text
        real(self, text[:len(text) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(report.Path, "write_text", crash)
    with pytest.raises(OSError):
        save_json(str(path), {"cells": [1, 2]})
    assert json.loads(path.read_text()) == {"cells": [1]}  # the last whole file stays


def test_save_figure_writes_a_png(tmp_path, capsys):
    fig, ax = pyplot().subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out


def test_machine_line_names_the_cpu_and_threads():
    assert platform_name() == (platform.processor() or platform.machine())
    cpu, threads = machine().rsplit(", ", 1)
    n = torch.get_num_threads()
    assert threads == f"{n} thread{'s' if n > 1 else ''}" and cpu
