"""Collectives in the shapes each compiler moves well: the same bits as ``lax.all_gather`` /
``lax.all_to_all``, sent differently on TPU (``lax.platform_dependent``), as they are elsewhere,
so CPU and GPU programs (and ``comm_report``'s bytes there) show the payloads' own dtypes.

What XLA:TPU does with the plain collectives (libtpu 0.0.42, compiled ahead of time for v5e and
v5p, ``experiments/bench/aot.py``):

* an **all-gather** whose per-device part is not a multiple of 128 elements (any dtype) becomes
  an all-reduce of the whole gathered buffer, zero-filled around each device's part: twice the
  bytes on the wire of a ring all-gather. QSDP's payloads (codes plus per-bucket statistics,
  e.g. 24576 + 192 bytes) are rarely such multiples.
* an **all-to-all** of 8- or 16-bit elements compiles in time linear in its size (36 s for
  21 MB of uint8 per device on v5p-8, 0.4 s as uint32).
So on TPU :func:`all_gather_rows`, :func:`padded_rows` and :func:`all_to_all_words` send 8- and
16-bit data as uint32 words, in parts of a multiple of 128 words (at most 511 bytes of padding
a part), and pad float parts to a multiple of 128 elements. (For the gathers the words also
held less than the padded uint8 parts: GPT-125M W8G8 on v5p-8, 1320 -> 1287 MB per chip.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

TPU_GATHER_MULTIPLE = 128  # elements per device part of an all-gather XLA:TPU runs as one


def all_gather_rows(x: jax.Array, axis_name, tiled: bool = False) -> jax.Array:
    """``lax.all_gather(x, axis_name, axis=0, tiled=tiled)``, bit for bit; on TPU in the form
    :func:`padded_rows` sends. ``tiled`` only for a 1-D ``x``."""
    if not _reshaped_on_tpu(x):
        return lax.all_gather(x, axis_name, axis=0, tiled=tiled)
    got = padded_rows(x, lambda v: lax.all_gather(v, axis_name, axis=0, tiled=False))
    return got.reshape(-1) if tiled else got


def padded_rows(x: jax.Array, gather) -> jax.Array:
    """``gather(x)`` for a ``gather`` that stacks ``x`` along new leading axes (all-gathers with
    ``tiled=False``). On TPU the last dimension goes as 32-bit words (8- and 16-bit elements
    packed, :func:`_as_words`) whose count is a multiple of :data:`TPU_GATHER_MULTIPLE`, the
    padding sliced off the result."""
    if not _reshaped_on_tpu(x):
        return gather(x)
    return lax.platform_dependent(x, tpu=lambda v: _as_words(v, gather), default=gather)


def _reshaped_on_tpu(x: jax.Array) -> bool:
    return jnp.dtype(x.dtype).itemsize < 4 or bool(x.shape[-1] % TPU_GATHER_MULTIPLE)


def all_to_all_words(x: jax.Array, axis_name) -> jax.Array:
    """``lax.all_to_all(x, axis_name, 0, 0, tiled=False)``, bit for bit; on TPU the rows of 8- or
    16-bit elements go as uint32 words (:func:`_as_words`), elsewhere as they are."""
    plain = lambda v: lax.all_to_all(v, axis_name, 0, 0, tiled=False)  # noqa: E731
    if jnp.dtype(x.dtype).itemsize >= 4 or x.dtype == jnp.bool_:
        return plain(x)
    return lax.platform_dependent(x, tpu=lambda v: _all_to_all_as_words(v, axis_name), default=plain)


def _all_to_all_as_words(x: jax.Array, axis_name) -> jax.Array:
    rows = x.reshape(x.shape[0], -1)
    return _as_words(rows, lambda w: lax.all_to_all(w, axis_name, 0, 0, tiled=False)).reshape(x.shape)


def _as_words(x: jax.Array, collective) -> jax.Array:
    """``collective(x)`` (one that keeps the last dimension) with ``x``'s last dimension sent as
    uint32 words, their count padded to a multiple of :data:`TPU_GATHER_MULTIPLE`: word ``j``
    holds element ``j`` of each of the dimension's 4 (8-bit) or 2 (16-bit) equal parts, put
    together with shifts (a bitcast through a ``(..., 4)`` uint8 array would hold a minor
    dimension of 4, which TPU layouts pad to 128: the W8G8 Gemma 3 270M step's v5p peak went
    4.9 -> 31.5 GB with it). 32-bit elements are only padded."""
    size = jnp.dtype(x.dtype).itemsize
    width = x.shape[-1]
    if size >= 4:
        pad = (-width) % TPU_GATHER_MULTIPLE
        return collective(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]))[..., :width]
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    per, shift = 4 // size, 8 * size
    v = lax.bitcast_convert_type(x, unsigned)
    v = jnp.pad(v, [(0, 0)] * (x.ndim - 1) + [(0, (-width) % (per * TPU_GATHER_MULTIPLE))])
    q = v.shape[-1] // per
    words = v[..., :q].astype(jnp.uint32)
    for k in range(1, per):
        words = words | (v[..., k * q : (k + 1) * q].astype(jnp.uint32) << jnp.uint32(k * shift))
    got = collective(words)
    mask = jnp.uint32((1 << shift) - 1)
    back = jnp.concatenate([((got >> jnp.uint32(k * shift)) & mask).astype(unsigned) for k in range(per)], axis=-1)
    return lax.bitcast_convert_type(back[..., :width], x.dtype)
