"""The hand-written CPU decode-attention kernel (`csrc/decode_attention.cpp`): built with the
machine's C++ compiler on first use, cached, and loaded; `layers/kernel_attention.py` calls it.

oneDNN's bf16 products read the decode shapes at ~5 GB/s per thread, far from what the memory
gives; the kernel reads each K/V row once, in place, with an online softmax (see below). Its
source is compiled once per (source, torch, Python, flags) into `$OASISKV_CACHE/ext/`
(default ~/.cache/oasiskv/ext; `scripts/setup.sh` builds it), so a run pays the ~1 minute
build only on a fresh machine, at engine start (`extension()` from the runner), never inside a
request. The one binary runs on any x86-64 CPU: its loops are compiled for AVX-512, AVX2+FMA
and the baseline and chosen by CPUID at run time; where the CPU has AVX-512 BF16, bf16 inputs
get the avx512bf16 tier (the scores by vdpbf16ps, no widening: dense 7K x6 2.15 -> 1.21 ms, at
the memory's speed; docs/results/2026-12-07-decode-kernel-avx512bf16.md).

Where it cannot be built or loaded (no compiler, no ninja, a build error) attention warns once
and decodes with `layers/gqa.py`, the same results to rounding. It is the default on the CPU;
OASISKV_ATTENTION=gqa chooses the grouped matmul path (no build). Its loops run on explicit
vectors (scores W keys a vector, a vector exp, P.V in registers). On a 2-core AMD EPYC (AVX-512,
Zen 4), two threads, bf16, ms per layer call (`scripts/bench_attention.py --rounds 5`, one run,
docs/results/2026-12-07-decode-kernel.md): dense 7K x1 0.40 vs gqa 0.62, dense 7K x6 2.24 vs
4.40, sparse K=128 x6 slabs 0.90 vs 1.10 (side by side) and 1.62 (apart); still compute-bound
(~14 GB/s for two threads: the scores' FMAs and lane reductions).
`load()` builds any source of csrc/ the same way (the rerank's `kv/block_mass.py`, the linear
layers' `layers/gemv.py`), each source its own choice of environment and fallback.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
ENV = "OASISKV_ATTENTION"
CHOICES = ("kernel", "gqa")
DTYPES = (torch.float32, torch.bfloat16)
# -fopenmp: at::parallel_for is OpenMP inlined from torch's headers (without it, one thread),
# sharing torch's libgomp (already loaded, the same soname); no fast-math (-inf must stay -inf
# for the masks), but a * b + c contracted to one FMA
FLAGS = ["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=fast"]
LDFLAGS = ["-fopenmp"]

_loaded: dict[Path, ModuleType | None] = {}
STALE_LOCK_S = 600  # a build lock older than this was left by a killed build


DEFAULT = "kernel"  # measured faster than gqa on every decode shape (see the note above)


def wanted() -> bool:
    """OASISKV_ATTENTION: kernel (the default) or gqa."""
    return choice(ENV, CHOICES, DEFAULT) == "kernel"


def choice(env: str, choices: tuple[str, ...], default: str) -> str:
    """The environment's choice among `choices` (a ValueError naming a bad value)."""
    value = os.environ.get(env, default).strip().lower()
    if value not in choices:
        raise ValueError(f"{env}={value!r}: expected one of {', '.join(choices)}")
    return value


def build_dir(source: Path) -> Path:
    """Where this source's build lives: one folder per source text (with the headers beside
    it, which it includes), torch, Python and flags."""
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, torch.__version__,
                                    sys.version, *FLAGS, *LDFLAGS]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("OASISKV_CACHE", Path.home() / ".cache" / "oasiskv"))
    return root / "ext" / f"{source.stem}_{key}"


def extension(source: Path | None = None) -> ModuleType | None:
    """The built kernel module (built on the first call, then cached on disk and here); None
    when OASISKV_ATTENTION=gqa or the build or load fails (warned once per source)."""
    if not wanted():
        return None
    return load(source or SOURCE, "the decode-attention kernel", "decoding with layers/gqa.py")


def load(source: Path, what: str, instead: str) -> ModuleType | None:
    """A C++ source in csrc/ built with this module's flags (cached on disk and here) and
    loaded; None where it cannot be built or loaded, with one warning per source ("`what`
    could not be built or loaded (why); `instead`"). The module must define isas()."""
    if source in _loaded:
        return _loaded[source]
    _loaded[source] = None  # a failure is not retried: one warning
    try:
        from torch.utils import cpp_extension

        path = build_dir(source)
        path.mkdir(parents=True, exist_ok=True)
        # a build killed midway leaves cpp_extension's lock behind, and every later load would
        # wait on it forever; a build takes a minute or two
        lock = path / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            warnings.warn(f"removing a stale build lock {lock}", RuntimeWarning, stacklevel=3)
            lock.unlink(missing_ok=True)
        # built from a copy in its folder: cpp_extension rebuilds whenever the source's path
        # changes (another checkout or worktree of the same text: ~20 s inside a step)
        for f in (source, *source.parent.glob("*.h")):
            if not (path / f.name).exists():
                tmp = path / f"{f.name}.{os.getpid()}.tmp"
                shutil.copyfile(f, tmp)
                os.replace(tmp, path / f.name)  # whole or absent, for a concurrent build
        ext = cpp_extension.load(name=f"oasiskv_{path.name}", sources=[str(path / source.name)],
                                 extra_cflags=list(FLAGS), extra_ldflags=list(LDFLAGS),
                                 build_directory=str(path), verbose=False)  # copies: load appends
        ext.isas()  # the module answers
    except Exception as e:  # any failure of a native build falls back, never fails the run
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        warnings.warn(f"{what} could not be built or loaded ({reason}); {instead}",
                      RuntimeWarning, stacklevel=3)
        return None
    _loaded[source] = ext
    return ext
