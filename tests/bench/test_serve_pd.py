"""`oasiskv bench serve` for prefill-decode disaggregation: the paper's shared-prefix groups
against hand-computed token lists, the store->decode byte windows and their statistics against
hand-computed values (from /metrics pages as the router labels them), the `pd:` server kind,
and one small run against a real `oasiskv pd --serve` (Mooncake master, storage node, one
prefill and one decode worker, the router) whose JSON carries the byte windows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import needs_mooncake

from oasiskv.bench.serve_bytes import decode_totals, window_stats, windows
from oasiskv.bench.serve_workload import (
    check_groups,
    group_prompts,
    make_workload,
    passages_needed,
    shared_len,
)
from oasiskv.bench.servers import ServerSettings, ServerSpec, parse_servers, server_command
from oasiskv.cli import main

# ten passages of 8 tokens: passage k is 100k, 100k + 1, ..., 100k + 7
PASSAGES = [[100 * k + j for j in range(8)] for k in range(10)]


def test_groups_share_their_first_h_of_the_prompt_and_nothing_else():
    # 2 groups of 4, h = 0.5 of 8 tokens: passages 0 and 1 are the prefixes, 2..9 the rest
    groups = group_prompts(PASSAGES, 2, 4, 8, 0.5)
    assert groups == [
        [[0, 1, 2, 3, 200, 201, 202, 203], [0, 1, 2, 3, 300, 301, 302, 303],
         [0, 1, 2, 3, 400, 401, 402, 403], [0, 1, 2, 3, 500, 501, 502, 503]],
        [[100, 101, 102, 103, 600, 601, 602, 603], [100, 101, 102, 103, 700, 701, 702, 703],
         [100, 101, 102, 103, 800, 801, 802, 803], [100, 101, 102, 103, 900, 901, 902, 903]]]
    load = make_workload(PASSAGES, 8, 8, 0.5, 4)
    assert load.warm == [groups[0][0], groups[1][0]]  # each group's first, sent before
    assert load.timed == groups[0][1:] + groups[1][1:]
    # h = 0.3: floor(2.4) = 2 shared tokens; h = 0: groups of unrelated prompts
    assert group_prompts(PASSAGES, 2, 4, 8, 0.3)[1][2] == [100, 101, 800, 801, 802, 803, 804,
                                                          805]
    assert make_workload(PASSAGES, 8, 8, 0.0, 4).warm == [PASSAGES[2], PASSAGES[6]]
    # groups of 2 from 6 passages; no groups: the passages themselves
    assert make_workload(PASSAGES[:6], 4, 8, 0.75, 2).timed == [
        [0, 1, 2, 3, 4, 5, 300, 301], [100, 101, 102, 103, 104, 105, 500, 501]]
    assert make_workload(PASSAGES, 3, 8).timed == PASSAGES[:3]
    assert make_workload(PASSAGES, 3, 8).warm == []
    assert [passages_needed(8, 0.5, 4), passages_needed(8, None, 4)] == [10, 8]
    assert shared_len(7168, 0.5) == 3584


@pytest.mark.parametrize("call, words", [
    (lambda: shared_len(8, 1.0), "--shared-prefix-fraction must be in [0, 1)"),
    (lambda: shared_len(8, -0.1), "--shared-prefix-fraction must be in [0, 1)"),
    (lambda: check_groups(6, 0.5, 4), "--num-prompts 6 is not a multiple of --group-size 4"),
    (lambda: check_groups(8, 0.5, 1), "--group-size must be at least 2"),
    (lambda: group_prompts(PASSAGES[:9], 2, 4, 8, 0.5), "need 10 passages of 8 tokens, got 9"),
])
def test_bad_group_settings_name_the_problem(call, words):
    with pytest.raises(ValueError) as e:
        call()
    assert words in str(e.value)


def page(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


def test_decode_totals_sum_the_decode_workers_of_a_router_page():
    router = page([
        "# TYPE oasiskv:sparse_store_to_host_bytes_total counter",
        'oasiskv:sparse_store_to_host_bytes_total{role="decode",worker="http://d1"} 100.0',
        'oasiskv:sparse_store_to_host_bytes_total{role="decode",worker="http://d2"} 50.0',
        'oasiskv:sparse_store_to_host_bytes_total{role="prefill",worker="http://p1"} 7.0',
        "# TYPE oasiskv:sparse_handoff_bytes_total counter",
        'oasiskv:sparse_handoff_bytes_total{role="decode",worker="http://d1"} 1000.0',
        'oasiskv:sparse_handoff_bytes_total{role="prefill",worker="http://p1"} 3.0',
        "# TYPE oasiskv:kv_host_bytes_used gauge",
        'oasiskv:kv_host_bytes_used{role="decode",worker="http://d1"} 4096.0',
        'oasiskv:kv_host_bytes_used{role="decode",worker="http://d2"} 1024.0',
        'oasiskv:kv_host_bytes_used{role="prefill",worker="http://p1"} 999.0',
        "# TYPE oasiskv_router:worker_up gauge",
        'oasiskv_router:worker_up{role="decode",worker="http://d1"} 1.0'])
    assert decode_totals(router) == {"store_to_host": 150.0, "handoff": 1000.0,
                                     "host_bytes": 5120.0}
    single = page(["# TYPE oasiskv:sparse_store_to_host_bytes_total counter",
                   "oasiskv:sparse_store_to_host_bytes_total 42.0"])  # one server: no role
    assert decode_totals(single) == {"store_to_host": 42.0, "handoff": 0.0, "host_bytes": 0.0}
    assert decode_totals(page(["# TYPE llamacpp:tokens_predicted_total counter",
                               "llamacpp:tokens_predicted_total 9.0"])) is None


def test_byte_windows_and_their_statistics_by_hand():
    # (seconds, total bytes): 100 B in the first second, none in the next, 300 B over 1.5 s
    got = windows([(0.0, 0.0), (1.0, 100.0), (2.0, 100.0), (3.5, 400.0)])
    assert got == [(1.0, 100.0), (2.0, 0.0), (3.5, 200.0)]
    stats = window_stats([r for _, r in got])
    # p99 of [0, 100, 200]: rank 0.99 * 2 = 1.98, so 100 + 0.98 * (200 - 100)
    assert stats == {"n": 3, "mean": pytest.approx(100.0), "p99": pytest.approx(198.0),
                     "max": 200.0}
    assert window_stats([]) == {"n": 0, "mean": None, "p99": None, "max": None}


def test_the_pd_server_kind_is_pd_serve_with_the_threads_shared_out():
    (spec,) = parse_servers("pd:transfer=slab,top_k=2,f_host=0.2,decode_workers=3")
    assert spec == ServerSpec("pd", (("transfer", "slab"), ("top_k", "2"), ("f_host", "0.2"),
                                     ("decode_workers", "3")))
    assert spec.label == "pd:transfer=slab,top_k=2,f_host=0.2,decode_workers=3"
    cmd = server_command(spec, ServerSettings("m", 4, 64, threads=8), 1234)
    i = cmd.index("pd")
    assert cmd[i:i + 4] == ["pd", "--serve", "--kv-mode", "sparse"]
    flags = dict(zip(cmd[i + 4::2], cmd[i + 5::2], strict=True))
    assert flags == {"--model": "m", "--host": "127.0.0.1", "--port": "1234",
                     "--dtype": "bfloat16", "--device": "cpu", "--device-kv-budget": "1GiB",
                     "--max-num-seqs": "4",
                     "--num-threads": "2",  # 8 threads over 1 prefill + 3 decode workers
                     "--transfer": "slab", "--top-k": "2", "--f-host": "0.2",
                     "--decode-workers": "3"}
    for bad, words in (("pd:transfer=half", "pd option transfer: expected partial, slab or "
                                            "full, got 'half'"),
                       ("pd:prefill_workers=0", "pd option prefill_workers: expected an "
                                                "integer >= 1"),
                       ("pd:store_bytes=lots", "pd option store_bytes"),
                       ("pd:transfer=full,nope=1", "unknown key 'nope'"),
                       ("pd:remote_store=inprocess", "pd sets remote_store itself"),
                       ("dense,transfer=full", "without a sparse:KEY=VAL or pd:KEY=VAL")):
        with pytest.raises(ValueError) as e:
            parse_servers(bad)
        assert words in str(e.value), bad


@needs_mooncake
def test_bench_serve_starts_pd_and_samples_the_store_to_decode_bytes(tiny_llama, tmp_path,
                                                                     capsys):
    out, png = tmp_path / "pd.json", tmp_path / "bytes.png"
    assert main(["bench", "serve", "--model", str(tiny_llama), "--servers",
                 "pd:transfer=partial,top_k=2,f_host=0.25,store_bytes=128MiB",
                 "--input-len", "96", "--output-len", "48", "--num-prompts", "8",
                 "--shared-prefix-fraction", "0.5", "--request-rate", "inf",
                 "--max-num-seqs", "3", "--device-kv-budget", "1MiB", "--dtype", "float32",
                 "--num-threads", "2", "--json", str(out), "--bytes-plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["complete"] and not data["errors"], data["errors"]
    assert (data["shared_prefix_fraction"], data["group_size"]) == (0.5, 4)
    (cell,) = data["cells"]
    assert cell["server"] == "pd:transfer=partial,top_k=2,f_host=0.25,store_bytes=128MiB"
    assert (cell["warm"]["requests"], cell["warm"]["completed"]) == (2, 2)  # one per group
    assert (cell["requests"], cell["completed"], cell["failed"]) == (6, 6, 0)
    assert all(r["output_tokens"] == 48 and r["usage_prompt_tokens"] == 96
               for r in cell["per_request"])
    b = cell["store_to_decode"]
    assert b["n"] == len(b["t_s"]) == len(b["bytes_per_s"]) >= 1
    assert b["handoff_bytes"] > 0  # six hand-overs admitted while the trace ran
    assert b["total_bytes"] == b["handoff_bytes"] + b["store_to_host_bytes"]
    # the windows tile the trace: their bytes add up to the counters' increase
    lengths = np.diff([0.0] + b["t_s"])
    assert float(np.dot(b["bytes_per_s"], lengths)) == pytest.approx(b["total_bytes"])
    assert b["mean"] == pytest.approx(np.mean(b["bytes_per_s"]))
    assert b["p99"] == pytest.approx(np.percentile(b["bytes_per_s"], 99))
    assert png.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "store->decode MiB/s mean/p99" in printed and "| pd:transfer=partial" in printed
