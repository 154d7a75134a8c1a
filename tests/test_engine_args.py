"""The engine flags' types and the flags -> `LLM(**kwargs)` mapping (`oasiskv/engine_args.py`),
against hand-written expectations for each annotation the config fields use."""

import argparse

import pytest

from oasiskv.config import EngineConfig
from oasiskv.engine_args import add_engine_flags, engine_kwargs, flag_type, parse_bool


@pytest.mark.parametrize("annotation, kind", [
    ("int", int), ("int | None", int), ("float", float), ("bool", parse_bool), ("str", str),
    ("str | None", str), ("int | str", str), ("float | str", str), (int, int), (float, float),
])
def test_flag_type_of_an_annotation(annotation, kind):
    assert flag_type(annotation) is kind


@pytest.mark.parametrize("text, value", [("true", True), ("On", True), ("1", True),
                                         ("no", False), ("FALSE", False), ("0", False)])
def test_parse_bool(text, value):
    assert parse_bool(text) is value


def test_parse_bool_refuses_other_words():
    with pytest.raises(argparse.ArgumentTypeError, match="expected true/false, got 'maybe'"):
        parse_bool("maybe")


def test_only_given_engine_flags_become_keywords():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    add_engine_flags(p)
    args = p.parse_args(["--json", "x.json", "--top-k", "8", "--prefault-kv", "yes",
                         "--f-hbm", "auto", "--num-threads", "2"])
    assert engine_kwargs(args) == {"top_k": 8, "prefault_kv": True, "f_hbm": "auto",
                                   "num_threads": 2}
    assert engine_kwargs(p.parse_args([])) == {}
    flags = {a.dest for a in p._actions} - {"help", "json"}
    assert flags == {f.name for _, f in EngineConfig.flat_fields()}
