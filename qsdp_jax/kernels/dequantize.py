"""Pallas kernels that dequantize received payloads: one pass from packed codes to float32.

* :func:`unpack_dequantize`: packed codes + per-bucket scales/offsets -> float32 (after the
  all-gather); equals ``qz.dequantize(qz.unpack_bits(...), ...)`` bit for bit.
* :func:`unpack_dequantize_sum`: the same for the N chunks received by the reduce-scatter,
  summed in float32 in the order of ``payload.sum_rows`` (pairwise halving), so the result
  equals the reference bit for bit.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from qsdp_jax._src.quant import quantizers as qz
from qsdp_jax.kernels import _pallas as kp
from qsdp_jax.kernels import _tpu


def _values(p_ref, s, off, bits, lead=()):
    """The 8 float32 value columns of one chunk's packed block."""
    byte_cols = [p_ref[lead + (slice(None), slice(None), j)].astype(jnp.uint32) for j in range(bits)]
    return [off + kp.to_f32(c) * s for c in kp.unpack_columns(byte_cols, bits)]


def _dequantize_kernel(p_ref, s_ref, o_ref, out_ref, *, bits):
    for k, v in enumerate(_values(p_ref, s_ref[...], o_ref[...], bits)):
        out_ref[:, :, k] = v


def _sum_kernel(p_ref, s_ref, o_ref, out_ref, *, bits, num):
    chunks = [_values(p_ref, s_ref[c], o_ref[c], bits, lead=(c,)) for c in range(num)]
    for k in range(8):
        out_ref[:, :, k] = kp.pairwise_sum([chunk[k] for chunk in chunks])


def _shape_checks(packed, scales, n, bits, bucket):
    kp.check_bits_bucket(bits, bucket)
    if n % bucket:
        raise ValueError(f"n={n} is not a multiple of bucket={bucket}")
    if packed.shape[-1] != qz.packed_size(n, bits):
        raise ValueError(f"packed length {packed.shape[-1]} does not match {n} codes of {bits} bits")
    if scales.shape[-1] != n // bucket:
        raise ValueError(f"{scales.shape[-1]} scales do not match {n // bucket} buckets")


def unpack_dequantize(packed, scales, offsets, bits, bucket, n, *, target):
    """uint8 (..., packed_size(n)), float32 (..., n // bucket) x2 -> float32 (..., n).

    Equals ``qz.dequantize(qz.unpack_bits(...), ...)`` bit for bit.

    Args:
      packed: uint8 ``(..., packed_size(n, bits))``, the packed codes.
      scales: float32 ``(..., n // bucket)``, the grid's step per bucket.
      offsets: float32 ``(..., n // bucket)``, the grid's lowest value per bucket.
      bits: bits per code, 1..8.
      bucket: elements per (scale, offset) pair, a positive multiple of 8.
      n: the number of codes per row.
      target: the Pallas lowering, one of ``_pallas.TARGETS``: ``"interpret"``, ``"triton"``
        (CUDA), ``"mosaic_tpu"`` or ``"tpu_interpret"`` (the TPU form in interpret mode; the TPU
        forms need a bucket that is a multiple of 128).

    Returns:
      The values ``offset + code * scale``, float32 ``(..., n)``.

    Raises:
      ValueError: ``bits`` not in 1..8; ``bucket`` not a positive multiple of 8; ``n`` not a
        multiple of ``bucket``; a packed length other than ``packed_size(n, bits)``; a scale count
        other than ``n // bucket``; an unknown ``target``.
    """
    _shape_checks(packed, scales, n, bits, bucket)
    kp.check_target(target, bucket)
    lead, g = packed.shape[:-1], bucket // 8
    rows = (n // bucket) * math.prod(lead)
    if target in kp.TPU_LAYOUT:
        p2, s2, o2 = packed.reshape(rows, -1), scales.reshape(rows, 1), offsets.reshape(rows, 1)
        return _tpu.dequantize(p2, s2, o2, bits=bits, bucket=bucket, num=0, target=target).reshape(*lead, n)
    rb = kp.row_block(rows, bucket, target)
    out = kp.call(
        functools.partial(_dequantize_kernel, bits=bits),
        jax.ShapeDtypeStruct((rows, g, 8), jnp.float32),
        [kp.rows_spec(rb, (g, bits)), kp.rows_spec(rb, (1,)), kp.rows_spec(rb, (1,))],
        kp.rows_spec(rb, (g, 8)),
        rows=rows,
        rb=rb,
        target=target,
        name=f"qsdp_unpack_dequantize_{bits}b",
    )(packed.reshape(rows, g, bits), scales.reshape(rows, 1), offsets.reshape(rows, 1))
    return out.reshape(*lead, n)


def unpack_dequantize_sum(packed, scales, offsets, bits, bucket, n, *, target):
    """uint8 (N, packed_size(n)), float32 (N, n // bucket) x2 -> float32 (n,): the sum over the
    N chunks of their dequantized values.

    Summed in float32 in the order of ``payload.sum_rows`` (pairwise halving), so the result
    equals the reference bit for bit.

    Args:
      packed: uint8 ``(N, packed_size(n, bits))``, the packed codes of the N received chunks.
      scales: float32 ``(N, n // bucket)``, each chunk's grid step per bucket.
      offsets: float32 ``(N, n // bucket)``, each chunk's lowest grid value per bucket.
      bits: bits per code, 1..8.
      bucket: elements per (scale, offset) pair, a positive multiple of 8.
      n: the number of codes per chunk.
      target: the Pallas lowering, one of ``_pallas.TARGETS``: ``"interpret"``, ``"triton"``
        (CUDA), ``"mosaic_tpu"`` or ``"tpu_interpret"`` (the TPU form in interpret mode; the TPU
        forms need a bucket that is a multiple of 128).

    Returns:
      The sum over the chunks, float32 ``(n,)``.

    Raises:
      ValueError: ``bits`` not in 1..8; ``bucket`` not a positive multiple of 8; ``n`` not a
        multiple of ``bucket``; a packed length other than ``packed_size(n, bits)``; a scale count
        other than ``n // bucket``; an unknown ``target``; ``packed`` not 2-D.
    """
    _shape_checks(packed, scales, n, bits, bucket)
    kp.check_target(target, bucket)
    if packed.ndim != 2:
        raise ValueError(f"packed chunks must be 2-D (N, bytes), got shape {packed.shape}")
    num, rows, g = packed.shape[0], n // bucket, bucket // 8
    if target in kp.TPU_LAYOUT:
        p3, s3, o3 = packed.reshape(num, rows, -1), scales.reshape(num, rows, 1), offsets.reshape(num, rows, 1)
        return _tpu.dequantize(p3, s3, o3, bits=bits, bucket=bucket, num=num, target=target).reshape(n)
    rb = kp.row_block(rows, bucket * num, target)
    out = kp.call(
        functools.partial(_sum_kernel, bits=bits, num=num),
        jax.ShapeDtypeStruct((rows, g, 8), jnp.float32),
        [kp.rows_spec(rb, (g, bits), (num,)), kp.rows_spec(rb, (1,), (num,)), kp.rows_spec(rb, (1,), (num,))],
        kp.rows_spec(rb, (g, 8)),
        rows=rows,
        rb=rb,
        target=target,
        name=f"qsdp_unpack_dequantize_sum_{bits}b",
    )(packed.reshape(num, rows, g, bits), scales.reshape(num, rows, 1), offsets.reshape(num, rows, 1))
    return out.reshape(n)
