"""The settings an evaluation compares (`eval/settings.py`): their names and engine keywords by
hand, and the flags that ask for them."""

import pytest

from oasiskv.cli import build_parser
from oasiskv.eval.settings import Setting, settings_from, settings_from_args


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="dense and/or sparse"):
        settings_from(["paged"], ["exact"], [32])


def test_pinned_block_settings_are_their_own_columns():
    settings = settings_from(["dense", "sparse"], ["exact"], [32], sinks=[0, 4], recents=[0, 2])
    assert [s.name for s in settings] == [
        "dense", "sparse K=32 exact", "sparse K=32 exact +2 recent", "sparse K=32 exact +4 sink",
        "sparse K=32 exact +4 sink +2 recent"]
    assert settings[-1].engine_kwargs() == {"kv_mode": "sparse", "predictor": "exact",
                                            "top_k": 32, "sink_blocks": 4, "recent_blocks": 2,
                                            "f_hbm": 0.05, "block_size": 16, "rerank": float("inf"),
                                            "forced_drafts": "known",
                                            "summary_dtype": "auto",
                                            "score_aggregation": "sum",
                                            "rerank_source": "int8"}


def test_scoring_options_are_their_own_columns():
    settings = settings_from(["sparse"], ["lookahead"], [128], reranks=[0.0, float("inf")],
                             aggregations=["sum", "softmax-sum"],
                             rerank_sources=["host", "int8"])
    # named where not the default (rerank=inf from the int8 copy); rerank=0 reads no keys
    assert [s.name for s in settings] == [
        "sparse K=128 lookahead rerank=0", "sparse K=128 lookahead rerank=inf host",
        "sparse K=128 lookahead", "sparse K=128 lookahead softmax-sum rerank=0",
        "sparse K=128 lookahead softmax-sum rerank=inf host",
        "sparse K=128 lookahead softmax-sum"]
    assert [(s.engine_kwargs()["score_aggregation"], s.engine_kwargs()["rerank_source"])
            for s in settings[3:]] == [("softmax-sum", "host"), ("softmax-sum", "host"),
                                       ("softmax-sum", "int8")]
    layers = settings_from(["dense", "sparse"], ["lookahead"], [128],
                           extra={"dense_layers": [0, 2], "summary_splits": [1, 2]})
    assert [s.name for s in layers] == ["dense", "sparse K=128 lookahead",
                                        "sparse K=128 lookahead summary_splits=2",
                                        "sparse K=128 lookahead dense_layers=2",
                                        "sparse K=128 lookahead dense_layers=2 summary_splits=2"]
    assert [s.engine_kwargs().get("dense_layers", 0) for s in layers[1:]] == [0, 0, 2, 2]
    only_int8 = settings_from(["sparse"], ["lookahead"], [128], reranks=[0.0, float("inf")],
                              rerank_sources=["int8"])
    assert [s.name for s in only_int8] == ["sparse K=128 lookahead rerank=0",
                                           "sparse K=128 lookahead"]
    int4 = settings_from(["sparse"], ["lookahead"], [128], rerank_sources=["int4"])
    assert [s.name for s in int4] == ["sparse K=128 lookahead rerank=inf int4"]


def test_rerank_settings_are_their_own_columns():
    settings = settings_from(["sparse"], ["lookahead"], [128], reranks=[0.0, float("inf")])
    assert [s.name for s in settings] == ["sparse K=128 lookahead rerank=0",
                                          "sparse K=128 lookahead"]
    assert [s.engine_kwargs()["rerank"] for s in settings] == [0.0, float("inf")]


def test_summary_dtypes_are_their_own_columns():
    settings = settings_from(["sparse"], ["lookahead"], [32], summary_dtypes=["auto", "bfloat16"])
    assert [s.name for s in settings] == ["sparse K=32 lookahead",
                                          "sparse K=32 lookahead bfloat16 summaries"]
    assert [s.engine_kwargs()["summary_dtype"] for s in settings] == ["auto", "bfloat16"]


def test_guessed_forced_drafts_are_their_own_lookahead_columns():
    settings = settings_from(["sparse"], ["lookahead", "exact"], [128],
                             forced_drafts=["known", "guessed"])
    assert [s.name for s in settings] == ["sparse K=128 lookahead",
                                          "sparse K=128 lookahead guessed drafts",
                                          "sparse K=128 exact"]  # no drafts to guess
    assert [s.engine_kwargs()["forced_drafts"] for s in settings] == ["known", "guessed",
                                                                      "known"]
    with pytest.raises(ValueError, match="--forced-drafts takes known and/or guessed"):
        settings_from(["sparse"], ["lookahead"], [128], forced_drafts=["maybe"])


def test_admission_caps_are_their_own_columns():
    settings = settings_from(["sparse"], ["lookahead"], [128], f_hbms=[0.05, 1.0, "auto"])
    assert [s.name for s in settings] == [
        "sparse K=128 lookahead", "sparse K=128 lookahead f_hbm=1.0",
        "sparse K=128 lookahead f_hbm=auto"]
    assert [s.engine_kwargs()["f_hbm"] for s in settings] == [0.05, 1.0, "auto"]





def test_the_flags_ask_for_the_same_settings_as_the_keywords():
    args = build_parser().parse_args(
        ["eval", "needle", "--kv-mode", "dense,sparse", "--predictor", "exact,lookahead",
         "--top-k", "32", "--sink-blocks", "0,2", "--f-hbm", "0.05,auto", "--rerank", "0",
         "--dense-layers", "0,1"])
    assert args.subcommand == "needle"
    by_flags = settings_from_args(args)
    by_hand = settings_from(["dense", "sparse"], ["exact", "lookahead"], [32], sinks=[0, 2],
                            f_hbms=[0.05, "auto"], reranks=[0.0],
                            extra={"dense_layers": [0, 1], "summary_splits": [1]})
    assert by_flags == by_hand and len(by_flags) == 1 + 2 * 2 * 2 * 2
    assert by_flags[0] == Setting("dense")
    assert "sparse K=32 lookahead rerank=0 +2 sink f_hbm=auto dense_layers=1" in [
        s.name for s in by_flags]
    ruler = settings_from_args(build_parser().parse_args(["eval", "ruler", "--top-k", "8"]))
    assert [s.name for s in ruler][:2] == ["dense", "sparse K=8 lookahead"]
