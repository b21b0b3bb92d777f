"""Collectives in the shapes each compiler moves well: the same bits as ``lax.all_gather`` /
``lax.all_to_all``, sent differently on TPU (``lax.platform_dependent``), as they are elsewhere,
so CPU and GPU programs (and ``comm_report``'s bytes there) show the payloads' own dtypes.

What XLA:TPU does with the plain collectives (libtpu 0.0.42, compiled ahead of time for v5e and
v5p, ``experiments/bench/aot.py``):

* an **all-gather** whose per-device part is not a multiple of 128 elements (any dtype) becomes
  an all-reduce of the whole gathered buffer, zero-filled around each device's part: twice the
  bytes on the wire of a ring all-gather. QSDP's payloads (codes plus per-bucket statistics,
  e.g. 24576 + 192 bytes) are rarely such multiples, so on TPU :func:`all_gather_rows` and
  :func:`padded_rows` pad each part to one (at most 127 elements).
* an **all-to-all** of 8- or 16-bit elements compiles in time linear in its size (36 s for
  21 MB of uint8 per device on v5p-8, 0.4 s as uint32); :func:`all_to_all_words` sends such
  rows as uint32 words.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

TPU_GATHER_MULTIPLE = 128  # elements per device part of an all-gather XLA:TPU runs as one


def all_gather_rows(x: jax.Array, axis_name, tiled: bool = False) -> jax.Array:
    """``lax.all_gather(x, axis_name, axis=0, tiled=tiled)``, bit for bit; on TPU with the last
    dimension padded to a multiple of :data:`TPU_GATHER_MULTIPLE` elements for the wire
    (:func:`padded_rows`). ``tiled`` only for a 1-D ``x``."""
    if not x.shape[-1] % TPU_GATHER_MULTIPLE:
        return lax.all_gather(x, axis_name, axis=0, tiled=tiled)
    got = padded_rows(x, lambda v: lax.all_gather(v, axis_name, axis=0, tiled=False))
    return got.reshape(-1) if tiled else got


def padded_rows(x: jax.Array, gather) -> jax.Array:
    """``gather(x)`` for a ``gather`` that stacks ``x`` along new leading axes (all-gathers with
    ``tiled=False``); on TPU ``x``'s last dimension is padded to a multiple of
    :data:`TPU_GATHER_MULTIPLE` for it, and the padding sliced off the result."""
    if not x.shape[-1] % TPU_GATHER_MULTIPLE:
        return gather(x)
    return lax.platform_dependent(x, tpu=lambda v: _padded(v, gather), default=gather)


def _padded(x: jax.Array, gather) -> jax.Array:
    pad = (-x.shape[-1]) % TPU_GATHER_MULTIPLE
    return gather(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]))[..., : x.shape[-1]]


def all_to_all_words(x: jax.Array, axis_name) -> jax.Array:
    """``lax.all_to_all(x, axis_name, 0, 0, tiled=False)``, bit for bit; on TPU as 32-bit words.

    XLA:TPU (v5e, v5p; libtpu 0.0.42) compiles an all-to-all of 8- or 16-bit elements in time
    linear in its size: 36 s for 21 MB of uint8 per device on v5p-8, 0.4 s for the same bytes
    as uint32 (all-gathers and collective-permutes of uint8 were not affected; XLA:GPU 0.1 s).
    On TPU the rows go as uint32 words, padded to whole words (at most 3 bytes a row; none for
    payloads of whole buckets of a multiple of 4 bytes). Elsewhere the bytes go as they are, so
    the compiled programs show the payloads' own dtypes (``comm_report``, the byte tests).
    """
    size = jnp.dtype(x.dtype).itemsize
    plain = lambda v: lax.all_to_all(v, axis_name, 0, 0, tiled=False)  # noqa: E731
    if size >= 4 or x.dtype == jnp.bool_:
        return plain(x)
    return lax.platform_dependent(x, tpu=lambda v: _all_to_all_as_words(v, axis_name), default=plain)


def _all_to_all_as_words(x: jax.Array, axis_name) -> jax.Array:
    # Word j of a row holds element j of each of the row's ``per`` equal parts (the row padded
    # to whole words), put together with shifts: a bitcast of a (..., 4) uint8 array would
    # hold a minor dimension of 4, which TPU layouts pad to 128 (the W8G8 Gemma 3 270M step's
    # v5p peak went 4.9 -> 31.5 GB with it).
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[jnp.dtype(x.dtype).itemsize]
    per = 4 // jnp.dtype(unsigned).itemsize
    rows = lax.bitcast_convert_type(x, unsigned).reshape(x.shape[0], -1)
    width = rows.shape[1]
    pad = (-width) % per
    if pad:
        rows = jnp.pad(rows, ((0, 0), (0, pad)))
    q = rows.shape[1] // per
    shift = 32 // per
    words = rows[:, :q].astype(jnp.uint32)
    for k in range(1, per):
        words = words | (rows[:, k * q : (k + 1) * q].astype(jnp.uint32) << jnp.uint32(k * shift))
    got = lax.all_to_all(words, axis_name, 0, 0, tiled=False)
    mask = jnp.uint32((1 << shift) - 1)
    parts = [((got >> jnp.uint32(k * shift)) & mask).astype(unsigned) for k in range(per)]
    back = jnp.concatenate(parts, axis=1)[:, :width]
    return lax.bitcast_convert_type(back.reshape(x.shape), x.dtype)
