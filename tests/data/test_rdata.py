"""Tests for the R lazy-load DB reader (oasiskv.data.rdata) and the Austen corpus.

The unit tests build their own lazy-load database with a small XDR serializer written here, so
they need neither R nor the Debian package; the last tests read the real r-cran-janeaustenr
data and are skipped when it is not installed.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import math
import os
import struct
import zlib
from pathlib import Path

import pytest

from oasiskv.data import austen
from oasiskv.data.austen import NOVELS, austen_corpus, austen_text, find_janeaustenr
from oasiskv.data.rdata import LazyLoadDB, RDataError, RVector, read_lazyload_db, unserialize

# ---------------------------------------------------------------------------------------------
# A minimal R serializer (XDR), enough to write test databases.
# ---------------------------------------------------------------------------------------------
NIL = struct.pack(">i", 254)  # NILVALUE_SXP
UTF8, LATIN1, BYTES, ASCII = 1 << 3, 1 << 2, 1 << 1, 1 << 6


def i32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def flags(sexp: int, *, attr: bool = False, tag: bool = False, levels: int = 0) -> bytes:
    return i32(sexp | attr << 9 | tag << 10 | levels << 12)


class Writer:
    """Serializes Python values the way R would serialize the matching R objects."""

    def __init__(self, version: int = 3, native: str = "UTF-8"):
        self.version, self.native = version, native
        self.symbols: dict[str, int] = {}

    def header(self) -> bytes:
        out = b"X\n" + i32(self.version, 0x040202, 0x030500 if self.version == 3 else 0x020300)
        if self.version == 3:
            out += i32(len(self.native)) + self.native.encode()
        return out

    def serialize(self, body: bytes) -> bytes:
        return self.header() + body

    # element writers -------------------------------------------------------------------------
    @staticmethod
    def charsxp(s: str | bytes | None, encoding: str | None = None) -> bytes:
        if s is None:
            return flags(9) + i32(-1)  # NA_STRING
        if isinstance(s, bytes):
            levels, raw = (BYTES if encoding == "bytes" else 0), s
        elif encoding == "latin1":
            levels, raw = LATIN1, s.encode("latin-1")
        elif s.isascii():
            levels, raw = ASCII, s.encode()
        else:
            levels, raw = UTF8, s.encode("utf-8")
        return flags(9, levels=levels) + i32(len(raw)) + raw

    def symbol(self, name: str) -> bytes:
        if name in self.symbols:  # REFSXP with the index packed into the flags
            return i32(255 | self.symbols[name] << 8)
        self.symbols[name] = len(self.symbols) + 1
        return flags(1) + self.charsxp(name)

    def attrs(self, attributes: dict[str, bytes] | None) -> bytes:
        return self.pairlist(attributes) if attributes else b""

    def pairlist(self, items: dict[str, bytes]) -> bytes:
        out = b""
        for tag, value in items.items():
            out += flags(2, tag=True) + self.symbol(tag) + value
        return out + NIL

    def strsxp(self, items, attributes=None, encoding=None) -> bytes:
        body = b"".join(self.charsxp(s, encoding) for s in items)
        return flags(16, attr=bool(attributes)) + i32(len(items)) + body + self.attrs(attributes)

    def intsxp(self, items, attributes=None, sexp: int = 13) -> bytes:
        values = [-(2**31) if v is None else int(v) for v in items]
        head = flags(sexp, attr=bool(attributes)) + i32(len(values))
        return head + i32(*values) + self.attrs(attributes)

    def lglsxp(self, items, attributes=None) -> bytes:
        return self.intsxp(items, attributes, sexp=10)

    def realsxp(self, items, attributes=None) -> bytes:
        head = flags(14, attr=bool(attributes)) + i32(len(items))
        return head + struct.pack(f">{len(items)}d", *items) + self.attrs(attributes)

    def vecsxp(self, items: list[bytes], attributes=None) -> bytes:
        head = flags(19, attr=bool(attributes)) + i32(len(items))
        return head + b"".join(items) + self.attrs(attributes)

    def named_list(self, items: dict[str, bytes]) -> bytes:
        return self.vecsxp(list(items.values()), {"names": self.strsxp(list(items))})


NA_REAL = struct.unpack(">d", bytes.fromhex("7ff00000000007a2"))[0]  # R's NA_real_ (1954)


def build_db(tmp_path: Path, objects: dict[str, bytes], compressed=True, kind: bytes = b"1",
             name: str = "Rdata") -> Path:
    """Write <name>.rdb/.rdx holding the given serializations (as R's makeLazyLoadDB does)."""
    rdb, offsets = b"", {}
    for obj_name, data in objects.items():
        size = struct.pack(">I", len(data))
        if compressed is True:
            record = size + zlib.compress(data)
        elif compressed is False:
            record = data
        else:
            payload = {b"0": data, b"1": zlib.compress(data), b"2": bz2.compress(data),
                       b"Z": lzma.compress(data)}[kind]
            record = size + kind + payload
        offsets[obj_name] = (len(rdb), len(record))
        rdb += record
    w = Writer()
    variables = w.named_list({k: w.intsxp(v) for k, v in offsets.items()})
    comp = w.lglsxp([compressed]) if isinstance(compressed, bool) else w.intsxp([compressed])
    index = w.named_list({"variables": variables, "references": w.vecsxp([], {"names":
                          w.strsxp([])}), "compressed": comp})
    (tmp_path / f"{name}.rdb").write_bytes(rdb)
    (tmp_path / f"{name}.rdx").write_bytes(gzip.compress(w.serialize(index)))  # like saveRDS
    return tmp_path / f"{name}.rdb"


def sample_objects() -> dict[str, bytes]:
    objs = {}
    w = Writer()
    objs["letters"] = w.serialize(w.strsxp(["a", None, "", "café", "£20,000"]))
    w = Writer()
    objs["latin"] = w.serialize(w.strsxp(["naïve"], encoding="latin1"))
    w = Writer()
    objs["ints"] = w.serialize(w.intsxp([1, None, -3], {"names": w.strsxp(["x", "y", "z"])}))
    w = Writer()
    objs["reals"] = w.serialize(w.realsxp([1.5, -0.0, math.inf, NA_REAL]))
    w = Writer()
    objs["flags"] = w.serialize(w.lglsxp([True, False, None]))
    w = Writer()  # "names" is written once as SYMSXP, then as REFSXP in the nested list
    objs["config"] = w.serialize(w.named_list({
        "a": w.intsxp([7]),
        "b": w.strsxp(["x"]),
        "c": NIL,
        "d": w.named_list({"e": w.lglsxp([True])}),
    }))
    w = Writer()
    objs["pairs"] = w.serialize(w.pairlist({"alpha": w.realsxp([2.0]), "beta": w.strsxp(["y"])}))
    w = Writer(version=2)
    objs["v2"] = w.serialize(w.vecsxp([flags(24) + i32(3) + b"\x00\x01\xff"]))
    return objs


# ---------------------------------------------------------------------------------------------
# Unit tests on self-built databases
# ---------------------------------------------------------------------------------------------
def test_reads_exact_values(tmp_path):
    db = read_lazyload_db(build_db(tmp_path, sample_objects()))
    assert list(db) == ["letters", "latin", "ints", "reals", "flags", "config", "pairs", "v2"]
    assert db["letters"] == ["a", None, "", "café", "£20,000"]
    assert db["letters"].rtype == "character" and db["letters"].attrs == {}
    assert db["latin"] == ["naïve"]
    assert db["ints"] == [1, None, -3] and db["ints"].names == ["x", "y", "z"]
    reals = db["reals"]
    assert reals[:3] == [1.5, 0.0, math.inf] and math.copysign(1, reals[1]) == -1
    assert math.isnan(reals[3])
    assert db["flags"] == [True, False, None] and db["flags"].rtype == "logical"
    config = db["config"].named()
    assert list(config) == ["a", "b", "c", "d"]
    assert config["a"] == [7] and config["b"] == ["x"] and config["c"] is None
    assert config["d"].named() == {"e": [True]}
    assert db["pairs"].rtype == "pairlist"
    assert db["pairs"].named() == {"alpha": [2.0], "beta": ["y"]}
    assert db["v2"] == [b"\x00\x01\xff"]


def test_lazy_access_and_path_forms(tmp_path):
    rdb = build_db(tmp_path, sample_objects())
    db = LazyLoadDB(rdb.with_suffix(""))  # the base name, as R's lazyLoad() takes it
    assert "ints" in db and "nope" not in db
    assert db["flags"] == [True, False, None]
    with pytest.raises(KeyError, match="nope"):
        db["nope"]
    assert read_lazyload_db(rdb, names=["latin"]) == {"latin": ["naïve"]}


@pytest.mark.parametrize("compressed,kind", [(False, b""), (2, b"0"), (2, b"1"), (3, b"1")])
def test_other_supported_record_layouts(tmp_path, compressed, kind):
    rdb = build_db(tmp_path, sample_objects(), compressed=compressed, kind=kind)
    assert LazyLoadDB(rdb)["letters"] == ["a", None, "", "café", "£20,000"]


@pytest.mark.parametrize("compressed,kind,name", [(2, b"2", "bzip2"), (3, b"2", "bzip2"),
                                                  (3, b"Z", "xz")])
def test_bzip2_xz_records_fail_clearly(tmp_path, compressed, kind, name):
    rdb = build_db(tmp_path, sample_objects(), compressed=compressed, kind=kind)
    with pytest.raises(RDataError, match=rf"\[letters\]: {name}-compressed record .*only zlib"):
        LazyLoadDB(rdb)["letters"]


def test_refsxp_with_index_in_next_int_and_native_encoding():
    w = Writer(native="latin1")
    unflagged = flags(16) + i32(1) + flags(9) + i32(2) + "é!".encode("latin-1")
    named = w.vecsxp([w.intsxp([1]), unflagged], {"names": w.strsxp(["a", "b"])})  # ref 1
    # A REFSXP whose index follows as its own int (flags >> 8 == 0) instead of being packed.
    body = flags(19) + i32(2) + named + i32(255) + i32(1)
    value = unserialize(w.serialize(body))
    assert value[0].named() == {"a": [1], "b": ["é!"]}  # unflagged string: native latin1
    assert value[1] == "names" and type(value[1]).__name__ == "RSymbol"


@pytest.mark.parametrize("sexp,name", [(3, "CLOSXP"), (4, "ENVSXP"), (238, "ALTREP_SXP"),
                                       (247, "PERSISTSXP"), (99, "unknown type 99")])
def test_unsupported_sexp_is_named(sexp, name):
    w = Writer()
    data = w.serialize(flags(19) + i32(1) + i32(sexp) + b"\x00" * 16)
    with pytest.raises(RDataError, match=rf"unsupported R SEXP type {name}"):
        unserialize(data)


def test_bad_headers_and_truncation():
    with pytest.raises(RDataError, match="ASCII"):
        unserialize(b"A\n3\n")
    with pytest.raises(RDataError, match="version 4"):
        unserialize(b"X\n" + i32(4, 0, 0))
    w = Writer()
    with pytest.raises(RDataError, match="truncated"):
        unserialize(w.serialize(w.strsxp(["abcdef"]))[:-3])


def test_vector_sanity():
    v = RVector([1, 2], "integer")
    assert v == [1, 2] and v.names is None
    with pytest.raises(RDataError, match="no names"):
        v.named()


# ---------------------------------------------------------------------------------------------
# Package discovery and caching (no real package needed)
# ---------------------------------------------------------------------------------------------
def test_missing_package_error(monkeypatch):
    for var in (austen.ENV_VAR, "R_LIBS", "R_LIBS_USER", "R_LIBS_SITE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(austen, "_R_LIBRARY_DIRS", ())
    with pytest.raises(FileNotFoundError, match="apt-get install r-cran-janeaustenr"):
        find_janeaustenr()
    monkeypatch.setenv(austen.ENV_VAR, "/nonexistent/janeaustenr")
    with pytest.raises(FileNotFoundError, match=austen.ENV_VAR):
        find_janeaustenr()


def test_env_override_and_cache_with_fake_package(tmp_path, monkeypatch):
    pkg = tmp_path / "lib" / "janeaustenr"
    (pkg / "data").mkdir(parents=True)
    w = Writer()
    fake = {n: w.serialize(w.strsxp([n.upper(), "", f"Line of {n}."])) for n in NOVELS}
    build_db(pkg / "data", fake)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for target in (pkg, pkg / "data", pkg / "data" / "Rdata.rdb"):
        monkeypatch.setenv(austen.ENV_VAR, str(target))
        assert find_janeaustenr() == pkg / "data" / "Rdata.rdb"
    monkeypatch.delenv(austen.ENV_VAR)
    monkeypatch.setenv("R_LIBS", str(tmp_path / "lib"))
    monkeypatch.setattr(austen, "_R_LIBRARY_DIRS", ())
    assert find_janeaustenr() == pkg / "data" / "Rdata.rdb"

    assert austen_text("emma") == "EMMA\n\nLine of emma."
    cached = tmp_path / "cache" / "oasiskv" / "austen" / "emma.txt"
    assert cached.read_text(encoding="utf-8") == "EMMA\n\nLine of emma."
    monkeypatch.delenv("R_LIBS")  # served from the cache without the package
    assert austen_text("emma") == "EMMA\n\nLine of emma."
    with pytest.raises(FileNotFoundError):
        austen_text("emma", use_cache=False)
    with pytest.raises(ValueError, match="unknown novel 'ulysses'"):
        austen_text("ulysses")
    with pytest.raises(ValueError, match="unknown novel"):
        austen_corpus(exclude=("ulysses",))


# ---------------------------------------------------------------------------------------------
# The real Debian package
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def real_rdb():
    if os.environ.get(austen.ENV_VAR):  # set explicitly: a wrong path is an error, not a skip
        return find_janeaustenr()
    try:
        return find_janeaustenr()
    except FileNotFoundError as e:
        pytest.skip(f"r-cran-janeaustenr not installed ({e})")


def test_real_package_all_novels(real_rdb, tmp_path, monkeypatch):
    db = read_lazyload_db(real_rdb)
    assert sorted(db) == sorted(NOVELS)
    words = {}
    for name in NOVELS:
        lines = db[name]
        assert lines.rtype == "character" and None not in lines and len(lines) > 7000
        words[name] = len("\n".join(lines).split())
        assert words[name] > 70_000
    pride = "\n".join(db["prideprejudice"])
    assert "It is a truth universally acknowledged, that a single man in possession" in pride
    assert "£20,000" in "\n".join(db["mansfieldpark"])  # a UTF-8 flagged CHARSXP
    assert sum(words.values()) > 700_000

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    emma = austen_text("emma")
    assert emma == "\n".join(db["emma"]) and emma.startswith("EMMA\n\nBy Jane Austen")
    assert (tmp_path / "oasiskv" / "austen" / "emma.txt").is_file()
    assert austen_text("emma") == emma
    corpus = austen_corpus(exclude=("emma",))
    assert "Emma Woodhouse, handsome" not in corpus and "It is a truth universally" in corpus
    assert len(corpus.split()) == sum(words.values()) - words["emma"]
