"""What every benchmark and evaluation reports with: markdown tables, JSON files, the lists
their flags take, plots, and the line that names the machine."""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path

import torch


def parse_list(text: str, kind: type = int) -> list:
    """"1,2,,4" -> [1, 2, 4]: a comma-separated flag's values, each read by `kind`."""
    return [kind(x) for x in str(text).split(",") if x.strip()]


def parse_f_hbms(text: str) -> list[float | str]:
    """"0.05,1.0,auto" -> [0.05, 1.0, "auto"]."""
    return [f if f == "auto" else float(f) for f in parse_list(text, str)]


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """columns: (key, header). Floats get 3 significant digits; a "|" inside a header or cell
    is escaped, so it cannot split the column."""
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v).replace("|", "\\|")

    head = "| " + " | ".join(fmt(h) for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def write_json(path: str | None, payload: dict) -> None:
    """`payload` to `path` (nothing without one), and a line saying so."""
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")


def save_json(path: str | None, payload: dict) -> None:
    """`payload` to `path` whole or not at all (written beside it, then renamed), silently: a
    long run saves as it goes, and a crash while writing keeps the last file."""
    if path:
        tmp = Path(path + ".partial")
        tmp.write_text(json.dumps(payload, indent=2, default=str))
        tmp.replace(path)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    print(f"wrote {path}")


def platform_name() -> str:
    """The processor as Python's platform module names it ("x86_64" where it knows no more)."""
    return platform.processor() or platform.machine()


def machine() -> str:
    """The CPU's model name (or the platform's word for it) and the threads torch uses."""
    try:
        names = re.findall(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    except OSError:
        names = []
    cpu = names[0].strip() if names else platform_name()
    threads = torch.get_num_threads()
    return f"{cpu}, {threads} thread{'s' if threads > 1 else ''}"
