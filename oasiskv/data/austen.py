"""Jane Austen's six novels, read from the Debian package ``r-cran-janeaustenr`` without R.

The package stores each novel as an R character vector of lines (Project Gutenberg text) in the
lazy-load database ``<R library>/janeaustenr/data/Rdata.rdb``. :func:`austen_text` joins the
lines with ``"\\n"`` (blank lines separate paragraphs) and caches the result in
``$XDG_CACHE_HOME/oasiskv/austen/<novel>.txt`` (default ``~/.cache``), so later calls only read
a text file and no longer need the package.

Install the data: ``apt-get install r-cran-janeaustenr`` (pulls in R), or without R:
``apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb DIR`` and set
``OASISKV_JANEAUSTENR=DIR/usr/lib/R/site-library/janeaustenr``.
"""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path

from oasiskv.data.rdata import LazyLoadDB, RDataError

__all__ = ["NOVELS", "ENV_VAR", "austen_text", "austen_corpus", "find_janeaustenr", "cache_dir"]

# Publication order (the order of janeaustenr::austen_books()).
NOVELS: tuple[str, ...] = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)
ENV_VAR = "OASISKV_JANEAUSTENR"
_INSTALL_HINT = (
    "install it with `apt-get install r-cran-janeaustenr`, or unpack the .deb "
    "(`apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb DIR`) and set "
    f"{ENV_VAR}=DIR/usr/lib/R/site-library/janeaustenr"
)
_R_LIBRARY_DIRS = (
    "/usr/lib/R/site-library",
    "/usr/local/lib/R/site-library",
    "/usr/lib/R/library",
    "/usr/local/lib/R/library",
    "/usr/lib64/R/library",
    "/usr/local/lib64/R/library",
    "/opt/homebrew/lib/R/*/site-library",
    "/Library/Frameworks/R.framework/Resources/library",
    "~/R/*/*",  # R_LIBS_USER default, e.g. ~/R/x86_64-pc-linux-gnu-library/4.2
)


def _rdb_in(path: Path) -> Path | None:
    """The novels' ``Rdata.rdb`` given that file, the package dir, or its ``data`` dir."""
    for candidate in (path, path / "data" / "Rdata.rdb", path / "Rdata.rdb"):
        if candidate.is_file() and candidate.with_suffix(".rdx").is_file():
            return candidate
    return None


def find_janeaustenr() -> Path:
    """Path of janeaustenr's ``data/Rdata.rdb``; ``$OASISKV_JANEAUSTENR`` overrides the search.

    The variable may name the ``.rdb`` itself, the package directory or its ``data`` directory.
    Otherwise ``$R_LIBS``, ``$R_LIBS_USER``, ``$R_LIBS_SITE`` and the usual R library
    directories are searched for ``janeaustenr/data/Rdata.rdb``.
    """
    override = os.environ.get(ENV_VAR)
    if override:
        found = _rdb_in(Path(override).expanduser())
        if found is None:
            raise FileNotFoundError(
                f"{ENV_VAR}={override!r} does not point to janeaustenr's data/Rdata.rdb "
                f"(+ .rdx), its data/ directory or the package directory; {_INSTALL_HINT}"
            )
        return found
    libs = [d for var in ("R_LIBS", "R_LIBS_USER", "R_LIBS_SITE")
            for d in os.environ.get(var, "").split(os.pathsep) if d]
    for pattern in (*libs, *_R_LIBRARY_DIRS):
        for lib in sorted(glob.glob(os.path.expanduser(pattern))):
            found = _rdb_in(Path(lib) / "janeaustenr")
            if found is not None:
                return found
    raise FileNotFoundError(f"R package janeaustenr (Jane Austen's novels) not found: "
                            f"{_INSTALL_HINT}")


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/oasiskv/austen`` (``~/.cache/oasiskv/austen`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "oasiskv" / "austen"


def _check_novel(novel: str) -> None:
    if novel not in NOVELS:
        raise ValueError(f"unknown novel {novel!r}; choose from {', '.join(NOVELS)}")


def _extract(db: LazyLoadDB, novel: str) -> str:
    lines = db[novel]
    if getattr(lines, "rtype", None) != "character":
        raise RDataError(f"{db.rdb_path}: {novel!r} is not a character vector")
    return "\n".join("" if line is None else line for line in lines)


def austen_text(novel: str, *, use_cache: bool = True) -> str:
    """The full text of one novel: its lines joined with ``"\\n"`` (no trailing newline).

    ``novel`` is one of :data:`NOVELS`. With ``use_cache`` the text is read from (or written
    to) :func:`cache_dir`; an unwritable cache is silently skipped.
    """
    _check_novel(novel)
    cached = cache_dir() / f"{novel}.txt"
    if use_cache and cached.is_file():
        return cached.read_text(encoding="utf-8")
    text = _extract(LazyLoadDB(find_janeaustenr()), novel)
    if use_cache:
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, cached)  # atomic: readers never see a partial file
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    return text


def austen_corpus(exclude: tuple[str, ...] = (), *, separator: str = "\n\n\n") -> str:
    """The novels of :data:`NOVELS` not in ``exclude``, in publication order, joined by
    ``separator``."""
    for novel in exclude:
        _check_novel(novel)
    return separator.join(austen_text(n) for n in NOVELS if n not in exclude)
