"""Reference (jnp) quantizers: buckets, grids, rounding modes, bit packing, QTensor.

Conventions (shared by the Pallas kernels, the collectives and the optimizer):

* A tensor is quantized along its **last axis** in buckets of ``bucket`` consecutive elements;
  leading axes are independent rows (e.g. the layers of a stacked group). The last axis must be
  a multiple of ``bucket``; :func:`pad_last` pads.
* Each bucket has a ``scale`` and an ``offset``; a code ``q`` in ``[0, 2**bits - 1]`` stands for
  ``offset + q * scale`` (:func:`dequantize`). Scales are rounded *up* to 16 significant bits
  (:func:`round_scale_up`), which makes ``q * scale`` exact in float32 for every 8-bit ``q``:
  dequantization then rounds once, so it gives the same bits with or without FMA contraction,
  on every device and backend. The lossless weight all-gather relies on this.
* Rounding modes:
    ``"stochastic"``: ``q = floor((x - lo) / s + u)``, ``u ~ U[0, 1)`` per element; unbiased,
      error < ``s`` per element, ``s = (hi - lo) / (2**bits - 1)``.
    ``"nearest"``: ``q = round((x - lo) / s)``; error <= ``s / 2``; biased.
    ``"shift"``: the QSDP grid projection. The grid is offset by a random fraction of a step,
      ``offset = lo - xi * s`` with ``xi ~ U[0, 1)`` per bucket, then round to nearest. With
      ``s = (hi - lo) / (2**bits - 2)`` the shifted grid covers ``[lo, hi]`` for every ``xi``,
      so nothing is clipped and ``E_xi[dequantize(q)] = x`` exactly (dithered rounding);
      error <= ``s / 2``. Needs ``bits >= 2``.
  A bucket whose values are all equal gets ``scale = 0`` and ``offset = lo``: exact.
* Compact stats (``stats_dtype="bfloat16"``, :func:`bf16_stats`): offset rounded down and scale
  up to bf16 values that still cover the bucket, so the stats travel as 2 bytes each. Such a
  grid reaches past ``[lo, hi]``: fine for one-shot quantization, not for values kept on it.
* Randomness is a counter-based hash of ``(key, counter)`` (:func:`hash_uniform`), computed
  identically in jnp and in Pallas kernels: elements use ``bucket_id * bucket + position`` as
  counter, bucket shifts use ``bucket_id``. Callers pass *global* bucket ids, so the same
  buffer quantizes the same way whether it is sharded over 1 or N devices.
* Packing: groups of 8 codes of ``b`` bits pack into exactly ``b`` bytes. For ``b`` in 1, 2, 4
  each byte holds ``8 / b`` whole codes, code ``j`` at bits ``[j*b, (j+1)*b)``; for ``b`` in
  3, 5, 6, 7 bit-plane order (byte ``j`` of a group holds bit ``j`` of its 8 codes, code ``k``
  at bit ``k``); ``b = 8`` is the identity.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

# counter-based randomness: its own module, re-exported here (``qz.hash_uniform``, ...)
from qsdp_jax._src.config.checks import STATS_DTYPES  # one definition: QSDPConfig checks the same names
from qsdp_jax._src.quant.randomness import GOLDEN, derive_key, hash_uniform, hash_uniform_rows, mix32  # noqa: F401

QRounding = Literal["stochastic", "nearest", "shift"]
ROUNDINGS = ("stochastic", "nearest", "shift")


# ----------------------------------------------------------------------------------------------
# Bucketing and grids
# ----------------------------------------------------------------------------------------------
def pad_last(x: jax.Array, multiple: int) -> jax.Array:
    """Zero-pad the last axis up to a multiple of ``multiple``."""
    n = x.shape[-1]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
    return jnp.pad(x, widths)


def to_buckets(x: jax.Array, bucket: int) -> jax.Array:
    """(..., n) -> (..., n // bucket, bucket); n must be a multiple of bucket."""
    n = x.shape[-1]
    if n % bucket:
        raise ValueError(f"last axis of length {n} is not a multiple of bucket={bucket}; pad it with pad_last")
    return x.reshape(*x.shape[:-1], n // bucket, bucket)


def bucket_range(xb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(min, max)`` over the last axis in one pass (one variadic reduction, not two).

    NaN propagates into both. On XLA:CPU one pass compiles to one kernel instead of two and
    ran 2x faster than ``jnp.min`` plus ``jnp.max`` on 8 x 0.8M elements.
    """

    def minmax(a, b):
        return lax.min(a[0], b[0]), lax.max(a[1], b[1])

    init = (jnp.array(jnp.inf, xb.dtype), jnp.array(-jnp.inf, xb.dtype))
    return lax.reduce((xb, xb), init, minmax, (xb.ndim - 1,))


def per_interval(span: jax.Array, intervals: int) -> jax.Array:
    """``span / intervals`` as XLA computes it: ``span`` times the float32 reciprocal of
    ``intervals`` (XLA rewrites a division by a constant so, on CPU and GPU alike). Written out,
    the Pallas kernels compute the same bits, where Triton would divide exactly (and differ in
    the last bit for most spans)."""
    return span * jnp.float32(1.0 / intervals)


def round_scale_up(s: jax.Array) -> jax.Array:
    """Round positive float32 scales up to 16 significant bits (see module docstring)."""
    bits = lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
    bits = (bits + jnp.uint32(0xFF)) & jnp.uint32(0xFFFFFF00)
    rounded = lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(jnp.isfinite(s) & (s > 0), rounded, s)


def _bf16_toward(x: jax.Array, up: bool) -> jax.Array:
    """float32 ``x`` rounded to a bfloat16 value (returned as float32) toward +inf (``up``) or
    -inf; non-finite values pass through."""
    x = x.astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    low = bits & jnp.uint32(0xFFFF)
    trunc = lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)  # toward zero
    away = lax.bitcast_convert_type((bits & jnp.uint32(0xFFFF0000)) + jnp.uint32(0x10000), jnp.float32)
    grow = (x > 0) if up else (x < 0)  # rounding away from zero moves toward the wanted side
    out = jnp.where((low != 0) & grow, away, trunc)
    return jnp.where(jnp.isfinite(x), out, x)


def bf16_stats(lo: jax.Array, hi: jax.Array, intervals: int) -> tuple[jax.Array, jax.Array]:
    """``(scales, offsets)`` of a grid of ``intervals`` steps made of bfloat16 values that covers
    ``[lo, hi]`` (``QSDPConfig.stats_dtype="bfloat16"``).

    The offset is ``lo`` rounded down to bf16, the scale ``(hi - offset) / intervals`` rounded up
    to bf16, one bf16 step more where float32 ``offset + intervals * scale`` (the top code's
    dequantized value, as :func:`dequantize` computes it) would still fall short of ``hi``: so
    no value of the bucket lies outside the grid and stochastic rounding stays unbiased. A bf16
    scale has 8 significant bits, so ``code * scale`` is exact in float32 (as with
    :func:`round_scale_up`). Costs resolution where ``|lo|`` is large against ``hi - lo``.
    """
    off = _bf16_toward(lo, up=False)
    s = _bf16_toward(per_interval(hi - off, intervals), up=True)
    short = off + jnp.float32(intervals) * s < hi
    bumped = lax.bitcast_convert_type(lax.bitcast_convert_type(s, jnp.uint32) + jnp.uint32(0x10000), jnp.float32)
    s = jnp.where(short & jnp.isfinite(s) & (s >= 0), bumped, s)
    return s, off


def levels(bits: int) -> int:
    return (1 << bits) - 1  # the largest code


def _check_bits(bits: int):
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r} is invalid: must be an integer in 1..8")


def default_bucket_ids(shape: tuple[int, ...], bucket: int) -> jax.Array:
    """Row-major bucket ids for an array of ``shape`` (last axis bucketed)."""
    nb = shape[-1] // bucket
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return jnp.arange(rows * nb, dtype=jnp.uint32).reshape(*shape[:-1], nb)


# ----------------------------------------------------------------------------------------------
# QTensor
# ----------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A bucket-quantized tensor.

    Invariant: ``dequantize(q)[..., i] == offsets[..., i // bucket] + codes[..., i] *
    scales[..., i // bucket]``, computed in float32 with one rounding (the product is exact),
    and every code lies in ``[0, 2**bits - 1]``.

    Attributes:
      codes: uint8 (..., n), unpacked (one code per byte).
      scales: float32 (..., n // bucket), >= 0.
      offsets: float32 (..., n // bucket).
      bits, bucket: static.
    """

    codes: jax.Array
    scales: jax.Array
    offsets: jax.Array
    bits: int = dataclasses.field(metadata=dict(static=True))
    bucket: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    def dequantize(self) -> jax.Array:
        return dequantize(self.codes, self.scales, self.offsets, self.bucket)


def dequantize(codes: jax.Array, scales: jax.Array, offsets: jax.Array, bucket: int) -> jax.Array:
    """``offset + code * scale`` per bucket, float32, shape of ``codes``."""
    q = to_buckets(codes.astype(jnp.float32), bucket)
    out = offsets[..., None] + q * scales[..., None]
    return out.reshape(codes.shape)


def _inverse(scales: jax.Array) -> jax.Array:
    """``1 / scales``, and 0 for a constant bucket (``scale == 0``), whose codes are then all 0.

    Quantizers multiply by it instead of dividing by the scale: a multiply is several times
    cheaper per element than a divide on CPU, and the codes stay exact on the grid (the product
    is within 2 ulp of the quotient, far inside the 0.5 rounding margin of a code <= 255).
    """
    return jnp.where(scales == 0, jnp.float32(0.0), 1.0 / jnp.where(scales == 0, 1.0, scales))


def unfused(product: jax.Array, guard: jax.Array) -> jax.Array:
    """``product``, behind a select on ``guard < 0`` for a ``guard`` that is never negative.

    The select between a product and the add that consumes it keeps a compiler from contracting
    the two into one FMA (XLA:CPU does under jit but not eagerly; Triton and XLA:GPU may): the
    sum then rounds twice in every compilation context, so the jnp reference and the Pallas
    kernels give the same bits wherever each is compiled. The condition must not be provable
    by the compiler (a predicate already tested around the product gets folded away).
    """
    return jnp.where(guard < 0, guard, product)


def quantize(
    x: jax.Array,
    bits: int,
    bucket: int,
    rounding: QRounding,
    key: jax.Array | None = None,
    bucket_ids: jax.Array | None = None,
    stats_dtype: str = "float32",
) -> QTensor:
    """Quantize ``x`` (..., n) bucket-wise along the last axis.

    Args:
      rounding: ``"stochastic"``, ``"nearest"`` or ``"shift"`` (see module docstring).
      key: uint32 key; required for ``"stochastic"`` and ``"shift"``.
      bucket_ids: uint32 (..., n // bucket) global ids of the buckets, used as counters for the
        randomness; defaults to row-major ids of ``x`` itself.
      stats_dtype: ``"float32"``, or ``"bfloat16"``: scales and offsets are bf16 values that
        cover each bucket's range (:func:`bf16_stats`); not with ``"shift"``.
    """
    if stats_dtype not in STATS_DTYPES:
        raise ValueError(f"stats_dtype={stats_dtype!r} is invalid: must be one of {STATS_DTYPES}")
    if stats_dtype != "float32" and rounding == "shift":
        raise ValueError("rounding='shift' needs stats_dtype='float32' (a random shift is not a bf16 value)")
    _check_bits(bits)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is invalid: must be one of {ROUNDINGS}")
    if rounding != "nearest" and key is None:
        raise ValueError(f"rounding={rounding!r} needs a key")
    if rounding == "shift" and bits < 2:
        raise ValueError("rounding='shift' needs bits >= 2 (one spare level covers the shift)")
    xb = to_buckets(x.astype(jnp.float32), bucket)
    lo, hi = bucket_range(xb)
    top = levels(bits)
    intervals = top - 1 if rounding == "shift" else top
    scales = round_scale_up(per_interval(hi - lo, intervals))
    if stats_dtype != "float32":
        scales, lo = bf16_stats(lo, hi, intervals)
    exact = scales == 0  # constant bucket: code 0 at offset lo
    if bucket_ids is None:
        bucket_ids = default_bucket_ids(x.shape, bucket)
    if rounding == "shift":
        assert key is not None  # checked above: every rounding but "nearest" has a key
        xi = hash_uniform(key, bucket_ids)
        offsets = jnp.where(exact, lo, lo - unfused(xi * scales, scales))
    else:
        offsets = lo
    inv = _inverse(scales)[..., None]
    t = (xb - offsets[..., None]) * inv
    if rounding == "stochastic":
        assert key is not None  # checked above
        u = hash_uniform_rows(key, bucket_ids, bucket)
        q = jnp.floor(unfused(t, u) + u)
    else:
        q = jnp.round(t)
    # Only the top needs a clip: x >= lo >= offset and inv >= 0 make t, hence q, >= 0 or NaN
    # (NaN reaches the uint8 conversion either way), and a clip at 0 too cost ~10% of this
    # pass on XLA:CPU. Same bits as jnp.clip(q, 0, top).
    q = jnp.minimum(q, top)
    codes = q.astype(jnp.uint8).reshape(x.shape)
    return QTensor(codes=codes, scales=scales, offsets=offsets, bits=bits, bucket=bucket)


def quantize_on_grid(x: jax.Array, scales: jax.Array, offsets: jax.Array, bits: int, bucket: int) -> QTensor:
    """Codes of ``x`` on a given grid (round to nearest, clipped). For ``x`` already on the grid
    this recovers its codes exactly, so ``dequantize`` reproduces ``x`` bit for bit."""
    xb = to_buckets(x.astype(jnp.float32), bucket)
    q = jnp.clip(jnp.round((xb - offsets[..., None]) * _inverse(scales)[..., None]), 0, levels(bits))
    return QTensor(
        codes=q.astype(jnp.uint8).reshape(x.shape),
        scales=scales,
        offsets=offsets,
        bits=bits,
        bucket=bucket,
    )


def error_bound(qt: QTensor, rounding: QRounding) -> jax.Array:
    """Per-bucket bound on |x - dequantize(q)|: ``scale`` for stochastic, ``scale/2`` otherwise
    (plus float32 rounding of the dequantized value)."""
    factor = 1.0 if rounding == "stochastic" else 0.5
    return qt.scales * factor


# ----------------------------------------------------------------------------------------------
# Bit packing
# ----------------------------------------------------------------------------------------------
def packed_size(n: int, bits: int) -> int:
    """Bytes holding ``n`` codes of ``bits`` bits: ``n`` for 8 bits, else ``ceil(n / 8) * bits``."""
    return n if bits == 8 else -(-n // 8) * bits


def _or_all(xs: list[jax.Array]) -> jax.Array:
    return functools.reduce(jnp.bitwise_or, xs)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 codes (..., n), each < 2**bits -> uint8 (..., packed_size(n, bits)).

    A tail of fewer than 8 codes is padded with zero codes (dropped again by unpack_bits).

    Every output byte is an OR of shifted codes read with static strided slices: one
    elementwise loop, with no reduction and no width-changing bitcast (XLA expands a uint8 <->
    uint32 bitcast into a shift-and-reduce kernel of its own, one more kernel to compile per
    call site).
    """
    _check_bits(bits)
    codes = codes.astype(jnp.uint8)
    if bits == 8:
        return codes
    codes = pad_last(codes, 8)
    lead = codes.shape[:-1]
    if 8 % bits == 0:  # 1, 2, 4 bits: 8 / bits whole codes per byte, code k at bits [k*b, (k+1)*b)
        per = 8 // bits
        g = codes.reshape(*lead, -1, per)
        return _or_all([g[..., k] << jnp.uint8(k * bits) for k in range(per)])
    m = codes.shape[-1] // 8  # bit planes: byte j holds bit j of the group's 8 codes, code k at bit k
    g = codes.reshape(*lead, m, 8)
    one = jnp.uint8(1)
    planes = [_or_all([((g[..., k] >> jnp.uint8(j)) & one) << jnp.uint8(k) for k in range(8)]) for j in range(bits)]
    return jnp.stack(planes, axis=-1).reshape(*lead, m * bits)


def unpack_bits(packed: jax.Array, bits: int, n: int) -> jax.Array:
    """Inverse of :func:`pack_bits`: uint8 (..., packed_size(n, bits)) -> uint8 codes (..., n).

    The row-major flattening of :func:`unpack_groups`: elementwise shifts of each byte, which
    XLA fuses into the op that reads the codes. A stack of shifted bytes interleaved by a
    reshape, as this was before, was written out whole when a decode read it (GPT-1.3B W4G4
    with code-held weights: two ``u8[24, 1048576, 2]`` temporaries of 48 MB, 164 MB more peak).
    """
    _check_bits(bits)
    if packed.shape[-1] != packed_size(n, bits):
        raise ValueError(f"packed length {packed.shape[-1]} does not match {n} codes of {bits} bits")
    if bits == 8:
        return packed
    return unpack_groups(packed, bits).reshape(*packed.shape[:-1], -1)[..., :n]


def unpack_groups(packed: jax.Array, bits: int) -> jax.Array:
    """:func:`unpack_bits` of whole groups, keeping the group axis: uint8 (..., m) -> codes
    (..., groups, codes per group), whose row-major flattening is ``unpack_bits(packed, bits,
    8 * m // bits)``. A group is one byte of ``8 // bits`` codes for 1, 2, 4 and 8 bits, else
    ``bits`` bytes of 8 codes (``m`` must hold whole groups).

    Every output reads its own group's bytes, contiguous and broadcast along the group axis:
    XLA:CPU vectorizes that loop, where a stack of shifted bytes interleaved by a reshape
    compiled to a loop it did not vectorize (8 x 0.5M codes, bucket 1024: 4 bits 2.2 -> 0.6 ms,
    3 bits 4.5 -> 1.0 ms, the dequantize included), which is why :func:`unpack_bits` is this.
    """
    _check_bits(bits)
    m = packed.shape[-1]
    lead = packed.shape[:-1]
    if bits == 8:
        return packed[..., None]
    if 8 % bits == 0:
        shifts = jnp.arange(8 // bits, dtype=jnp.uint8) * jnp.uint8(bits)
        return (packed[..., None] >> shifts) & jnp.uint8((1 << bits) - 1)
    if m % bits:
        raise ValueError(f"{m} bytes are not whole groups of {bits} bytes")
    g = packed.reshape(*lead, m // bits, bits)
    k = jnp.arange(8, dtype=jnp.uint8)
    one = jnp.uint8(1)
    return _or_all([((g[..., j : j + 1] >> k) & one) << jnp.uint8(j) for j in range(bits)])
