"""`bench serve`'s markdown table: a row per (server, rate) cell, and what its columns mean."""

from __future__ import annotations

from oasiskv.report import markdown_table

MiB = 2**20


def _three(d: dict, scale: float = 1.0) -> str:
    if not d.get("n"):
        return ""
    return " / ".join(f"{d[k] * scale:.3g}" for k in ("p50", "p90", "max"))


def table_rows(cells: list[dict]) -> list[dict]:
    rows = []
    for c in cells:
        row = {k: c.get(k) for k in ("server", "rate", "request_throughput",
                                     "output_throughput", "failed", "rejected", "accuracy")}
        row["n"] = f"{c['completed']}/{c['requests']}"
        row["ttft"] = _three(c["ttft_ms"], 1e-3)
        row["e2e"] = _three(c["e2e_ms"], 1e-3)
        row["tpot"], row["itl"] = _three(c["tpot_ms"]), _three(c["itl_ms"])
        row["itl_n"] = c["itl_ms"]["n"]
        if "good" in c:
            row["goodput"] = f"{c['goodput']:.3g} ({c['good']}/{c['requests']})"
        if c.get("warm") is not None:
            row["warm"] = f"{c['warm']['completed']}/{c['warm']['requests']}"
        b = c.get("store_to_decode")
        if b and b["n"]:
            row["bytes"] = f"{b['mean'] / MiB:.3g} / {b['p99'] / MiB:.3g}"
            row["bytes_n"] = b["n"]
            if c["completed"]:
                row["admission"] = b["handoff_bytes"] / c["completed"] / MiB
            row["host_peak"] = b["decode_host_bytes_peak"] / MiB
        rows.append(row)
    return rows


COLUMNS = [("server", "server"), ("accuracy", "accuracy"), ("rate", "rate req/s"),
           ("n", "n ok"), ("failed", "failed"), ("rejected", "503"),
           ("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
           ("goodput", "goodput req/s (good)"), ("ttft", "TTFT s p50/p90/max"),
           ("tpot", "TPOT ms p50/p90/max"), ("itl", "ITL ms p50/p90/max"),
           ("itl_n", "ITL n"), ("e2e", "E2E s p50/p90/max"), ("warm", "warm ok"),
           ("bytes", "store->decode MiB/s mean/p99"), ("bytes_n", "windows"),
           ("admission", "hand-over MiB/req"), ("host_peak", "decode host KV MiB peak")]
OPTIONAL = ("accuracy", "warm", "bytes", "bytes_n", "admission", "host_peak")


def report(result: dict) -> None:
    a = result
    conc = f", at most {a['max_concurrency']} in flight" if a["max_concurrency"] else ""
    h = a.get("shared_prefix_fraction")
    groups = (f" in groups of {a['group_size']} sharing the first {h:g} of the prompt (one per "
              "group sent first, untimed: warm)" if h is not None else "")
    print(f"\n## serving, {a['model']}: {a['num_prompts']} requests per rate{groups}, "
          f"{a['input_len']}-token prompts, {a['output_len']} output tokens{conc}\n")
    rows = table_rows(a["cells"])
    columns = [c for c in COLUMNS if c[0] not in OPTIONAL
               or any(r.get(c[0]) is not None for r in rows)]
    print(markdown_table(rows, columns))
    slo = ", ".join(f"{k[:-3].upper()} <= {v:.3g} ms" for k, v in a["slo"].items() if v)
    cal = a["calibration"]
    how = (f" ({cal['x']:g} x the median TPOT of {cal['server']} with one request in flight, "
           f"{cal['tpot_ms']['p50']:.3g} ms, n={cal['tpot_ms']['n']})" if cal else "")
    print("\nrate: offered (Poisson arrivals; inf: all at once); n ok: completed / sent; "
          "503: turned away at saturation (not failures); TTFT, TPOT = (e2e - TTFT) / "
          "(output tokens - 1) and E2E over the n completed requests; ITL over every gap "
          "between token chunks (ITL n); goodput = requests meeting the SLO per second"
          + (f"; SLO: {slo}{how}" if slo else " (no SLO given)")
          + ("; store->decode: the decode side's store reads and admitted hand-overs per "
             "second in each 1 s window of the trace (windows: their number), hand-over per "
             "completed request, decode-host KV in use at its peak" if any(
                 r.get("bytes") for r in rows) else "")
          + f". max_num_seqs / llama-server slots {a['max_num_seqs']}, device KV budget "
          f"{a['device_kv_budget']}, {a['threads']} threads. {a.get('time_s', 0):.0f} s.")
    for e in a["errors"]:
        print(f"{e['server']}: {e['error'].splitlines()[0]}")
