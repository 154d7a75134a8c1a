"""The local stage's row copy (`kv/row_copy.py`, `layers/csrc/copy_rows.cpp`) against
PyTorch's indexing: bf16 and fp32 pools, source rows repeated, on 1 and 2 threads; bad
indices and shapes refused by name; the indexing path where the kernel cannot be built, off
a contiguous pool, and for no rows."""

import os
import time
import warnings

import pytest
import torch

from oasiskv.kv import row_copy
from oasiskv.layers import decode_kernel


def pools(dtype, n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(500, 48, generator=g).to(dtype)
    dst = torch.randn(200, 48, generator=g).to(dtype)
    dst_rows = torch.randperm(200, generator=g)[:n % 200 or 200]
    src_rows = torch.randint(0, 500, (len(dst_rows),), generator=g)  # repeats
    return dst, dst_rows, src, src_rows


def reference(dst, dst_rows, src, src_rows):
    want = dst.clone()
    want[dst_rows] = src[src_rows]
    return want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_copies_what_indexing_copies(dtype, threads):
    assert row_copy.extension() is not None, "the kernel builds and loads on this machine"
    dst, dst_rows, src, src_rows = pools(dtype, n=173)
    want = reference(dst, dst_rows, src, src_rows)
    row_copy.copy_rows(dst, dst_rows, src, src_rows)
    assert torch.equal(dst, want)


def test_bad_indices_and_shapes_are_refused_by_name():
    ext = row_copy.extension()
    dst, dst_rows, src, src_rows = pools(torch.float32)
    before = dst.clone()
    src_rows[7] = 500
    with pytest.raises(RuntimeError, match="row 7: dst .* src 500 of 500"):
        ext.copy_rows(dst, dst_rows, src, src_rows)
    assert torch.equal(dst, before)  # checked before anything is written
    with pytest.raises(RuntimeError, match="rows of one dtype and width"):
        ext.copy_rows(dst, dst_rows, src[:, :40].contiguous(), src_rows.clamp(max=10))
    n = len(dst_rows)
    with pytest.raises(RuntimeError, match=rf"as many dst rows \({n}\) as src rows \(3\)"):
        ext.copy_rows(dst, dst_rows, src, src_rows[:3])


def test_no_rows_and_a_strided_pool(threads):
    dst, dst_rows, src, src_rows = pools(torch.float32)
    before = dst.clone()
    row_copy.copy_rows(dst, dst_rows[:0], src, src_rows[:0])
    assert torch.equal(dst, before)
    strided = dst.t().contiguous().t()  # not contiguous: PyTorch's indexing
    want = reference(strided, dst_rows, src, src_rows)
    row_copy.copy_rows(strided, dst_rows, src, src_rows)
    assert torch.equal(strided, want)


def test_indexing_with_one_warning_where_the_kernel_cannot_be_built(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error broken on purpose\n")
    monkeypatch.setenv("OASISKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(row_copy, "SOURCE", broken)
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    dst, dst_rows, src, src_rows = pools(torch.bfloat16)
    want = reference(dst, dst_rows, src, src_rows)
    with pytest.warns(RuntimeWarning, match="row-copy kernel could not be built"):
        row_copy.copy_rows(dst, dst_rows, src, src_rows)
    assert torch.equal(dst, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        row_copy.copy_rows(dst, dst_rows, src, src_rows)


def test_the_same_source_at_another_path_is_not_built_again(tmp_path, monkeypatch):
    """The build is keyed by the text and built from a copy in its folder: another checkout
    or worktree of the same source loads the same build (cpp_extension rebuilds whenever a
    source's path changes: ~20 s, which once landed inside a decode step)."""
    monkeypatch.setenv("OASISKV_CACHE", str(tmp_path / "cache"))
    sources = []
    for where in ("a", "b"):
        (tmp_path / where).mkdir()
        for f in (row_copy.SOURCE, *row_copy.SOURCE.parent.glob("*.h")):
            (tmp_path / where / f.name).write_text(f.read_text())
        sources.append(tmp_path / where / row_copy.SOURCE.name)
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    assert decode_kernel.load(sources[0], "x", "y") is not None
    built = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.so")}
    assert len(built) == 1
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    assert decode_kernel.load(sources[1], "x", "y") is not None
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.so")} == built


def test_a_sparse_engine_loads_the_kernel_before_its_first_step(tiny_llama, monkeypatch):
    from oasiskv import LLM

    monkeypatch.setattr(decode_kernel, "_loaded", {})
    LLM(str(tiny_llama), kv_mode="sparse", top_k=2)
    assert decode_kernel._loaded.get(row_copy.SOURCE) is not None


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch):
    """cpp_extension waits forever on a build folder's lock; one older than any build is
    removed (with a warning) and the kernel builds."""
    monkeypatch.setenv("OASISKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    path = decode_kernel.build_dir(row_copy.SOURCE)
    path.mkdir(parents=True)
    (path / "lock").touch()
    old = time.time() - decode_kernel.STALE_LOCK_S - 60
    os.utime(path / "lock", (old, old))
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        assert row_copy.extension() is not None
