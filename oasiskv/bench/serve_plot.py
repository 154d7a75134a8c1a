"""`bench serve --plot`: latency against load, one line per server through its request rates:
TPOT p90, TTFT p90 and goodput against the request throughput each rate achieved (an offered
rate of inf has no place on a rate axis; what the server delivered does)."""

from __future__ import annotations

from oasiskv.report import pyplot, save_figure


def plot(cells: list[dict], path: str, title: str, slo_tpot_ms: float | None = None) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    servers = list(dict.fromkeys(c["server"] for c in cells))
    for name in servers:
        pts = [c for c in cells if c["server"] == name and c.get("request_throughput")]
        if not pts:
            continue
        xs = [c["request_throughput"] for c in pts]
        series = ((axes[0], [c["tpot_ms"]["p90"] for c in pts]),
                  (axes[1], [c["ttft_ms"]["p90"] / 1e3 for c in pts]),
                  (axes[2], [c.get("goodput") for c in pts]))
        for ax, ys in series:
            if any(y is None for y in ys):
                continue
            line, = ax.plot(xs, ys, "o-", label=name)
            for c, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(str(c["rate"]), (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=line.get_color())
    if slo_tpot_ms is not None:
        axes[0].axhline(slo_tpot_ms, color="black", linestyle="--", linewidth=1,
                        label=f"SLO {slo_tpot_ms:.3g} ms")
    for ax, label in zip(axes, ("TPOT p90 (ms)", "TTFT p90 (s)", "goodput (requests / s)"),
                         strict=True):
        ax.set_xlabel("request throughput (requests / s; labels: offered rate)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    save_figure(fig, path)


def plot_bytes(cells: list[dict], path: str, title: str) -> None:
    """`bench serve --bytes-plot`: the store->decode bytes per second in each 1 s window of
    each cell's trace, one line per (server, rate), its p99 dotted."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.4))
    for c in cells:
        b = c.get("store_to_decode")
        if not b or not b["n"]:
            continue
        line, = ax.step(b["t_s"], [x / 2**20 for x in b["bytes_per_s"]], where="pre",
                        label=f"{c['server']} @ {c['rate']} (p99 {b['p99'] / 2**20:.3g})")
        ax.axhline(b["p99"] / 2**20, color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("seconds into the trace (each step: one window)")
    ax.set_ylabel("store -> decode MiB/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title)
    save_figure(fig, path)
