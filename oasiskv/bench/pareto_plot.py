"""`bench pareto --plot`: accuracy (passkey and needle together) and the perplexity ratio
against TPS, one line per configuration through its concurrency levels, dense marked."""

from __future__ import annotations

from oasiskv.report import pyplot, save_figure

MARKERS = "osD^v<>px"


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()
    fig, (acc, ppl) = plt.subplots(1, 2, figsize=(11, 4.4))
    levels = sorted({r["concurrency"] for r in rows})
    marker = {c: MARKERS[i % len(MARKERS)] for i, c in enumerate(levels)}
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(settings):
        pts = sorted((r for r in rows if r["setting"] == name), key=lambda r: r["concurrency"])
        dense = name == "dense"
        color = "black" if dense else colors[i % len(colors)]
        xs = [r["tps"] for r in pts]
        for ax, key, lo, hi in ((acc, "accuracy", "accuracy_delta_lo", "accuracy_delta_hi"),
                                (ppl, "ppl_ratio", "ppl_ratio_lo", "ppl_ratio_hi")):
            if dense and key == "ppl_ratio":
                ys = [1.0] * len(pts)  # the reference every ratio is to
            elif any(r.get(key) is None for r in pts):
                continue
            else:
                ys = [r[key] for r in pts]
            ax.plot(xs, ys, "-" if not dense else "--", color=color, linewidth=2 if dense else 1,
                    label=name)
            for r, x, y in zip(pts, xs, ys, strict=True):
                ax.plot(x, y, marker="*" if dense else marker[r["concurrency"]], color=color,
                        markersize=13 if dense else 7)
                if not dense and lo in r:  # the paired interval of the difference to dense
                    shift = r["accuracy"] - r["accuracy_delta"] if key == "accuracy" else 0
                    ax.errorbar(x, y, yerr=[[max(0, y - r[lo] - shift)],
                                            [max(0, r[hi] + shift - y)]],
                                color=color, capsize=3, linewidth=1)
                ax.annotate(f"{r['concurrency']}", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color)
    acc.set_ylabel("passkey + needle accuracy (x100; bars: 95% CI vs dense)")
    ppl.set_ylabel("perplexity / dense (bars: 95% CI)")
    for ax in (acc, ppl):
        ax.set_xlabel("output tokens / s (point labels: requests at once; * = dense)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    save_figure(fig, path)
