"""Read R's serialized data without R: a minimal XDR unserializer and a lazy-load DB reader.

R stores package data (``data/Rdata.rdb`` + ``.rdx``) as a *lazy-load database*:

* ``<base>.rdx`` is an ``.rds`` file (``saveRDS``: gzip, or uncompressed) holding a named list
  ``variables`` (name -> integer ``c(offset, length)`` into the ``.rdb``), ``references`` and
  ``compressed`` (``TRUE`` = zlib, or ``2``/``3``).
* ``<base>.rdb`` is a concatenation of records. With ``compressed = TRUE`` a record is a 4-byte
  big-endian uncompressed length followed by a zlib stream; with ``2``/``3`` a type byte
  follows the length (``'0'`` none, ``'1'`` zlib, ``'2'`` bzip2, ``'Z'`` xz). Each decompressed
  record is one R serialization of the object.

The unserializer handles the XDR format (``X\\n``), versions 2 and 3, and the SEXP types plain
data needs (vectors, strings, lists, pairlists, symbols, references). Anything else (closures,
environments, ALTREP, ...) raises :class:`RDataError` naming the SEXP type.

Python values: character/logical/integer/double/complex vectors and lists become
:class:`RVector` (a ``list`` with ``rtype`` and an ``attrs`` dict); ``NA`` becomes ``None``
except for doubles, where ``NA`` and ``NaN`` are both ``float('nan')``. Raw vectors become
``bytes``; symbols :class:`RSymbol`; ``NULL`` ``None``. Pairlists become an :class:`RVector`
with ``rtype="pairlist"`` whose tags are its ``names`` attribute.

Why not the ``rdata`` package (PyPI; looked at 1.1.0, 2026-12): it requires pandas and
xarray (``import rdata`` imports its converters, which import both), neither of which this
project otherwise needs, to read six character vectors; and it reads ``.rda``/``.rds`` files
only (its ``RDB2``/``RDB3`` magics are native-binary ``.rda``, not lazy-load databases): no
reader of the ``.rdb``/``.rdx`` pair, so the index and record code below would stay ours and
rdata would replace only the XDR unserializer and its value types (about 200 lines). So this
module stays.
"""

from __future__ import annotations

import codecs
import gzip
import struct
import zlib
from pathlib import Path

__all__ = [
    "RDataError",
    "RSymbol",
    "RVector",
    "LazyLoadDB",
    "unserialize",
    "read_rds",
    "read_lazyload_db",
]


class RDataError(ValueError):
    """The data is malformed or uses a feature this reader does not support."""


class RSymbol(str):
    """An R symbol (``SYMSXP``), e.g. a tag or attribute name."""

    def __repr__(self) -> str:
        return f"RSymbol({str.__repr__(self)})"


class RVector(list):
    """An R vector: its elements as a list, its R type and its attributes (``names``, ...)."""

    def __init__(self, items=(), rtype: str = "list", attrs: dict | None = None):
        super().__init__(items)
        self.rtype = rtype
        self.attrs = attrs if attrs is not None else {}

    @property
    def names(self) -> list[str | None] | None:
        return self.attrs.get("names")

    def named(self) -> dict:
        """The elements keyed by their names (requires a ``names`` attribute)."""
        if self.names is None:
            raise RDataError(f"R {self.rtype} has no names attribute")
        return dict(zip(self.names, self, strict=True))

    def __repr__(self) -> str:
        extra = f", attrs={self.attrs!r}" if self.attrs else ""
        return f"RVector({list.__repr__(self)}, rtype={self.rtype!r}{extra})"


SEXP_NAMES = {
    0: "NILSXP", 1: "SYMSXP", 2: "LISTSXP", 3: "CLOSXP", 4: "ENVSXP", 5: "PROMSXP",
    6: "LANGSXP", 7: "SPECIALSXP", 8: "BUILTINSXP", 9: "CHARSXP", 10: "LGLSXP", 13: "INTSXP",
    14: "REALSXP", 15: "CPLXSXP", 16: "STRSXP", 17: "DOTSXP", 18: "ANYSXP", 19: "VECSXP",
    20: "EXPRSXP", 21: "BCODESXP", 22: "EXTPTRSXP", 23: "WEAKREFSXP", 24: "RAWSXP",
    25: "S4SXP", 238: "ALTREP_SXP", 239: "ATTRLISTSXP", 240: "ATTRLANGSXP",
    241: "BASEENV_SXP", 242: "EMPTYENV_SXP", 243: "BCREPREF", 244: "BCREPDEF",
    245: "GENERICREFSXP", 246: "CLASSREFSXP", 247: "PERSISTSXP", 248: "PACKAGESXP",
    249: "NAMESPACESXP", 250: "BASENAMESPACE_SXP", 251: "MISSINGARG_SXP",
    252: "UNBOUNDVALUE_SXP", 253: "GLOBALENV_SXP", 254: "NILVALUE_SXP", 255: "REFSXP",
}
_NA_INT = -(2**31)
# CHARSXP "levels" bits (gp field) giving the string's encoding.
_BYTES, _LATIN1, _UTF8, _ASCII = 1 << 1, 1 << 2, 1 << 3, 1 << 6
_VECTOR_TYPES = {10: "logical", 13: "integer", 14: "double", 15: "complex", 16: "character",
                 19: "list", 20: "expression"}


class _Unserializer:
    def __init__(self, data: bytes):
        self.buf = memoryview(data)
        self.pos = 0
        self.refs: list = []
        self.native_encoding = "utf-8"

    # -- primitive reads (XDR = big-endian) ----------------------------------------------
    def _take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise RDataError(f"truncated R serialization (need {n} bytes at {self.pos})")
        chunk = self.buf[self.pos:end]
        self.pos = end
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints, upper and lower 32 bits
            upper, lower = struct.unpack(">II", self._take(8))
            n = (upper << 32) | lower
        if n < 0:
            raise RDataError(f"negative vector length {n}")
        return n

    # -- header -------------------------------------------------------------------------
    def header(self) -> None:
        magic = bytes(self._take(2))
        if magic != b"X\n":
            kind = {b"A\n": "ASCII", b"B\n": "native binary"}.get(magic, repr(magic))
            raise RDataError(f"unsupported R serialization format {kind}; only XDR ('X\\n')")
        version = self.int()
        self.int()  # R version that wrote it
        self.int()  # minimal R version to read it
        if version == 3:
            name = bytes(self._take(self.int())).decode("ascii")
            self.native_encoding = _python_encoding(name)
        elif version != 2:
            raise RDataError(f"unsupported R serialization version {version}")

    # -- items --------------------------------------------------------------------------
    def item(self):
        flags = self.int()
        sexp = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))

        if sexp == 254:  # NILVALUE_SXP
            return None
        if sexp == 255:  # REFSXP: index packed in the flags, or in the next int
            index = flags >> 8 or self.int()
            if not 0 < index <= len(self.refs):
                raise RDataError(f"bad REFSXP index {index}")
            return self.refs[index - 1]
        if sexp == 1:  # SYMSXP: its name as a CHARSXP; joins the reference table
            sym = RSymbol(self.item())
            self.refs.append(sym)
            return sym
        if sexp == 2:  # LISTSXP
            return self.pairlist(has_attr, has_tag)
        if sexp == 9:  # CHARSXP
            return self.charsxp(levels)
        if sexp == 24:  # RAWSXP
            value = bytes(self._take(self.length()))
            if has_attr:
                self.attributes()  # raw vectors with attributes: attributes are dropped
            return value
        if sexp in _VECTOR_TYPES:
            vec = RVector(self.vector_items(sexp), _VECTOR_TYPES[sexp])
            if has_attr:
                vec.attrs = self.attributes()
            return vec
        name = SEXP_NAMES.get(sexp, f"unknown type {sexp}")
        raise RDataError(f"unsupported R SEXP type {name} ({sexp}) at byte {self.pos - 4}")

    def vector_items(self, sexp: int) -> list:
        n = self.length()
        if sexp in (10, 13):  # logical, integer
            raw = struct.unpack(f">{n}i", self._take(4 * n))
            if sexp == 10:
                return [None if v == _NA_INT else bool(v) for v in raw]
            return [None if v == _NA_INT else v for v in raw]
        if sexp == 14:  # double (NA_real_ is a NaN and stays one)
            return list(struct.unpack(f">{n}d", self._take(8 * n)))
        if sexp == 15:  # complex
            parts = struct.unpack(f">{2 * n}d", self._take(16 * n))
            return [complex(parts[i], parts[i + 1]) for i in range(0, 2 * n, 2)]
        return [self.item() for _ in range(n)]  # character, list, expression

    def charsxp(self, levels: int) -> str | bytes | None:
        n = self.int()
        if n == -1:
            return None  # NA_STRING
        raw = bytes(self._take(n))
        if levels & _BYTES:
            return raw
        if levels & _UTF8:
            return raw.decode("utf-8")
        if levels & _LATIN1:
            return raw.decode("latin-1")
        if levels & _ASCII:
            return raw.decode("ascii")
        return raw.decode(self.native_encoding)

    def attributes(self) -> dict:
        attrs = self.item()
        if not isinstance(attrs, RVector) or attrs.rtype != "pairlist" or attrs.names is None:
            raise RDataError(f"attributes should be a tagged pairlist, got {attrs!r:.80}")
        return dict(zip(attrs.names, attrs, strict=True))

    def pairlist(self, has_attr: bool, has_tag: bool) -> RVector:
        # Read iteratively along the CDR chain (R writes ATTRIB, TAG, CAR, then the CDR item).
        values, tags, attrs = [], [], {}
        while True:
            if has_attr:
                attrs.update(self.attributes())
            tag = self.item() if has_tag else None
            tags.append(None if tag is None else str(tag))
            values.append(self.item())
            flags = self.int()
            sexp = flags & 0xFF
            if sexp == 254:  # NILVALUE_SXP ends the list
                break
            if sexp != 2:
                raise RDataError(f"pairlist CDR is {SEXP_NAMES.get(sexp, sexp)}, not LISTSXP")
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if any(t is not None for t in tags):
            attrs.setdefault("names", tags)
        return RVector(values, "pairlist", attrs)


def _python_encoding(r_name: str) -> str:
    """Python codec for the native encoding named in a version-3 header (e.g. ``UTF-8``)."""
    name = {"latin1": "latin-1", "native.enc": "utf-8", "": "utf-8"}.get(r_name.lower(), r_name)
    try:
        return codecs.lookup(name).name
    except LookupError as e:
        raise RDataError(f"unknown native encoding {r_name!r} in R serialization header") from e


def unserialize(data: bytes):
    """Unserialize one R object from the bytes of an (uncompressed) XDR serialization."""
    u = _Unserializer(data)
    u.header()
    return u.item()


_COMPRESSED_MAGIC = {b"BZh": "bzip2", b"\xfd7zXZ": "xz"}


def read_rds(path: str | Path):
    """Read an ``.rds`` file (``saveRDS``) written gzip-compressed or uncompressed."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    for magic, kind in _COMPRESSED_MAGIC.items():
        if data.startswith(magic):
            raise RDataError(f"{path}: {kind}-compressed .rds is not supported (only gzip)")
    return unserialize(data)


def _decompress_record(record: bytes, compressed, where: str) -> bytes:
    if not compressed:
        return record
    if len(record) < 4:
        raise RDataError(f"{where}: record too short")
    size = struct.unpack(">I", record[:4])[0]
    if compressed in (True, 1):
        kind, payload = "1", record[4:]
    elif compressed in (2, 3):
        kind, payload = chr(record[4]), record[5:]
    else:
        raise RDataError(f"{where}: unknown lazy-load compression {compressed!r}")
    if kind == "1":
        data = zlib.decompress(payload)
    elif kind == "0":
        data = payload
    else:
        name = {"2": "bzip2", "Z": "xz"}.get(kind, f"type byte {kind!r}")
        raise RDataError(f"{where}: {name}-compressed record is not supported (only zlib)")
    if len(data) != size:
        raise RDataError(f"{where}: decompressed {len(data)} bytes, header says {size}")
    return data


class LazyLoadDB:
    """An R lazy-load database (``<base>.rdb`` + ``<base>.rdx``); objects are read on access."""

    def __init__(self, rdb_path: str | Path):
        path = Path(rdb_path)
        self.rdb_path = path if path.suffix == ".rdb" else path.with_name(path.name + ".rdb")
        self.rdx_path = self.rdb_path.with_suffix(".rdx")
        index = read_rds(self.rdx_path)
        if not isinstance(index, RVector) or index.names is None:
            raise RDataError(f"{self.rdx_path}: index is not a named list")
        index = index.named()
        variables = index.get("variables")
        if variables is None:
            raise RDataError(f"{self.rdx_path}: index has no 'variables'")
        self.offsets: dict[str, tuple[int, int]] = {
            name: (int(pos[0]), int(pos[1])) for name, pos in variables.named().items()
        }
        compressed = index.get("compressed", [True])
        self.compressed = compressed[0] if isinstance(compressed, list) else compressed

    def names(self) -> list[str]:
        return list(self.offsets)

    def __contains__(self, name: object) -> bool:
        return name in self.offsets

    def __getitem__(self, name: str):
        if name not in self.offsets:
            raise KeyError(f"{name!r} not in {self.rdb_path} (has: {', '.join(self.offsets)})")
        offset, length = self.offsets[name]
        with open(self.rdb_path, "rb") as f:
            f.seek(offset)
            record = f.read(length)
        if len(record) != length:
            raise RDataError(f"{self.rdb_path}: record {name!r} truncated")
        where = f"{self.rdb_path} [{name}]"
        try:
            return unserialize(_decompress_record(record, self.compressed, where))
        except zlib.error as e:
            raise RDataError(f"{where}: bad zlib data: {e}") from e


def read_lazyload_db(rdb_path: str | Path, names: list[str] | None = None) -> dict[str, object]:
    """Read all (or the given) objects of a lazy-load database into a dict name -> value."""
    db = LazyLoadDB(rdb_path)
    return {name: db[name] for name in (db.names() if names is None else names)}
