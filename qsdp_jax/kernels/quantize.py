"""Pallas kernels that quantize: one pass from float32 values to codes on a grid.

* :func:`quantize_pack`: per-bucket min/max grid, stochastic / nearest / shift rounding, packed
  codes plus scales and offsets (gradients before the reduce-scatter, ``"comm"`` weights).
* :func:`grid_pack`: codes of values on a given grid, packed (QSDP weights before the gather).
* :func:`project`: a fresh grid and the values on it (the optimizer's projection).
* :func:`snap`: values moved exactly onto a given grid (the optimizer's snap).

Each equals its jnp reference in :mod:`qsdp_jax._src.quant.quantizers` bit for bit. Inputs are ``(..., n)``
with ``n`` a multiple of ``bucket`` (pad with ``qz.pad_last`` as the reference requires).
``target`` is one of ``_pallas.TARGETS``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qsdp_jax._src.quant import quantizers as qz
from qsdp_jax.kernels import _pallas as kp
from qsdp_jax.kernels import _tpu

_GOLDEN = 0x9E3779B9  # a Python int: a jnp constant here would start JAX's backends at import


def _kernel(*refs, bits, rounding, output, target):
    """One row block. Inputs: x (rb, G, 8) then per rounding: stochastic (key (1,1), base
    (rb,1)), shift (xi (rb,1)), grid (scales, offsets (rb,1)), nearest nothing. Outputs: packed
    (rb, G, bits) or values (rb, G, 8), then scales and offsets unless rounding is "grid"."""
    x_ref, *rest = refs
    n_in = {"stochastic": 2, "shift": 1, "grid": 2, "nearest": 0}[rounding]
    aux, outs = rest[:n_in], rest[n_in:]
    cols = [x_ref[:, :, k] for k in range(8)]
    top = qz.levels(bits)
    if rounding == "grid":
        s, off = aux[0][...], aux[1][...]
    else:
        lo = jnp.min(functools.reduce(jnp.minimum, cols), axis=1, keepdims=True)
        hi = jnp.max(functools.reduce(jnp.maximum, cols), axis=1, keepdims=True)
        intervals = top - 1 if rounding == "shift" else top
        s = kp.round_scale_up(qz.per_interval(hi - lo, intervals))
        off = lo
        if rounding == "shift":
            xi = aux[0][...]
            off = jnp.where(s == 0, lo, lo - qz.unfused(xi * s, s))
    inv = kp.inverse(s, target)
    if rounding == "stochastic":
        key = aux[0][...]
        pos = jax.lax.broadcasted_iota(jnp.uint32, cols[0].shape, 1) * jnp.uint32(8)
        ctr0 = aux[1][...] + pos
    qs = []
    for k, col in enumerate(cols):
        t = (col - off) * inv
        if rounding == "stochastic":
            u = kp.uniform(qz.mix32(qz.mix32(ctr0 + jnp.uint32(k)) ^ key))
            q = jnp.clip(jnp.floor(qz.unfused(t, u) + u), 0.0, float(top))
        else:
            q = kp.round_even(jnp.clip(t, 0.0, float(top)))
        qs.append(q)
    out = outs[0]
    if output == "values":
        for k, q in enumerate(qs):
            out[:, :, k] = off + q * s
    else:
        for j, byte in enumerate(kp.pack_columns([kp.to_u32(q) for q in qs], bits)):
            out[:, :, j] = byte.astype(jnp.uint8)
    if rounding != "grid":
        outs[1][...] = s
        outs[2][...] = off


def _run(x, row_aux, scalar_aux, *, bits, bucket, rounding, output, target):
    """Flatten ``x`` (..., n) to one row per bucket, run ``target``'s form of the kernel, restore
    the leading shape. ``scalar_aux`` (a key) precedes ``row_aux`` (one value per bucket) in the
    kernel's inputs."""
    kp.check_bits_bucket(bits, bucket)
    kp.check_target(target, bucket)
    if x.shape[-1] % bucket:
        raise ValueError(f"last axis of length {x.shape[-1]} is not a multiple of bucket={bucket}")
    lead, n = x.shape[:-1], x.shape[-1]
    nb = n // bucket
    rows = nb
    for d in lead:
        rows *= d
    scalars = [jnp.asarray(a).reshape(1, 1) for a in scalar_aux]
    per_row = [jnp.broadcast_to(a, (*lead, nb)).reshape(rows, 1) for a in row_aux]
    form = _tpu.quantize if target in kp.TPU_LAYOUT else _grouped
    res = form(
        x.astype(jnp.float32).reshape(rows, bucket), per_row, scalars,
        bits=bits, bucket=bucket, rounding=rounding, output=output, target=target,
    )  # fmt: skip
    if rounding == "grid":
        return res.reshape(*lead, -1)
    return res[0].reshape(*lead, -1), res[1].reshape(*lead, nb), res[2].reshape(*lead, nb)


def _grouped(x, per_row, scalars, *, bits, bucket, rounding, output, target):
    """The Triton / interpret form over ``x`` ``(rows, bucket)``: ``(rows, bucket // 8, 8)``
    groups (see ``_pallas``)."""
    rows, g = x.shape[0], bucket // 8
    rb = kp.row_block(rows, bucket, target)
    args = [x.reshape(rows, g, 8), *scalars, *per_row]
    specs = [kp.rows_spec(rb, (g, 8))] + [kp.scalar_spec()] * len(scalars)
    specs += [kp.rows_spec(rb, (1,))] * len(per_row)
    width = 8 if output == "values" else bits
    dtype = jnp.float32 if output == "values" else jnp.uint8
    out_shape = [jax.ShapeDtypeStruct((rows, g, width), dtype)]
    out_specs = [kp.rows_spec(rb, (g, width))]
    if rounding != "grid":
        out_shape += [jax.ShapeDtypeStruct((rows, 1), jnp.float32)] * 2
        out_specs += [kp.rows_spec(rb, (1,))] * 2
    kernel = functools.partial(_kernel, bits=bits, rounding=rounding, output=output, target=target)
    name = f"qsdp_{'project' if output == 'values' else 'quantize_pack'}_{rounding}_{bits}b"
    res = kp.call(kernel, tuple(out_shape), specs, tuple(out_specs), rows=rows, rb=rb, target=target, name=name)(*args)
    return res[0] if rounding == "grid" else res


def _fresh_grid_aux(x, bits, bucket, rounding, key, bucket_ids):
    """(row_aux, scalar_aux) of a fresh-grid rounding, after the reference's argument checks."""
    if rounding not in qz.ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is invalid: must be one of {qz.ROUNDINGS}")
    if rounding != "nearest" and key is None:
        raise ValueError(f"rounding={rounding!r} needs a key")
    if rounding == "shift" and bits < 2:
        raise ValueError("rounding='shift' needs bits >= 2 (one spare level covers the shift)")
    if bucket_ids is None:
        bucket_ids = qz.default_bucket_ids(x.shape, bucket)
    bucket_ids = jnp.asarray(bucket_ids).astype(jnp.uint32)
    if rounding == "stochastic":
        key = jnp.asarray(key, jnp.uint32)
        return [bucket_ids * jnp.uint32(bucket) + key * jnp.uint32(_GOLDEN)], [key]
    if rounding == "shift":
        return [qz.hash_uniform(key, bucket_ids)], []
    return [], []


def quantize_pack(x, bits, bucket, rounding, key=None, bucket_ids=None, *, target):
    """``(pack_bits(codes), scales, offsets)`` of ``qz.quantize(x, ...)`` in one pass.

    A fresh per-bucket min/max grid (float32 stats only), the codes on it packed.

    Args:
      x: values ``(..., n)``, ``n`` a multiple of ``bucket`` (quantized as float32).
      bits: bits per code, 1..8 (2..8 with ``"shift"``).
      bucket: elements per (scale, offset) pair, a positive multiple of 8.
      rounding: ``"stochastic"``, ``"nearest"`` or ``"shift"`` (as ``qz.quantize``).
      key: the uint32 key of the randomness; required for ``"stochastic"`` and ``"shift"``.
      bucket_ids: uint32 ``(..., n // bucket)`` global ids of the buckets, the counters of the
        randomness; None (the default): the row-major ids of ``x`` itself.
      target: the Pallas lowering, one of ``_pallas.TARGETS``: ``"interpret"``, ``"triton"``
        (CUDA), ``"mosaic_tpu"`` or ``"tpu_interpret"`` (the TPU form in interpret mode; the TPU
        forms need a bucket that is a multiple of 128).

    Returns:
      A tuple ``(packed, scales, offsets)`` of uint8 ``(..., packed_size(n, bits))`` and
      float32 ``(..., n // bucket)`` twice.

    Raises:
      ValueError: ``bits`` not in 1..8; ``bucket`` not a positive multiple of 8; a last axis that
        is not whole buckets; an unknown ``rounding`` or ``target``; ``"stochastic"`` /
        ``"shift"`` without a key; ``"shift"`` with ``bits < 2``.
    """
    row_aux, scalar_aux = _fresh_grid_aux(x, bits, bucket, rounding, key, bucket_ids)
    return _run(x, row_aux, scalar_aux, bits=bits, bucket=bucket, rounding=rounding, output="pack", target=target)


def grid_pack(x, scales, offsets, bits, bucket, *, target):
    """``pack_bits(qz.quantize_on_grid(x, scales, offsets, ...).codes)`` in one pass.

    The codes of ``x`` on a given grid (round to nearest, clipped), packed; for ``x`` already on
    the grid they are its exact codes.

    Args:
      x: values ``(..., n)``, ``n`` a multiple of ``bucket`` (read as float32).
      scales: float32 ``(..., n // bucket)``, the grid's step per bucket.
      offsets: float32 ``(..., n // bucket)``, the grid's lowest value per bucket.
      bits: bits per code, 1..8.
      bucket: elements per (scale, offset) pair, a positive multiple of 8.
      target: the Pallas lowering, one of ``_pallas.TARGETS``: ``"interpret"``, ``"triton"``
        (CUDA), ``"mosaic_tpu"`` or ``"tpu_interpret"`` (the TPU form in interpret mode; the TPU
        forms need a bucket that is a multiple of 128).

    Returns:
      The packed codes, uint8 ``(..., packed_size(n, bits))``.

    Raises:
      ValueError: ``bits`` not in 1..8; ``bucket`` not a positive multiple of 8; a last axis that
        is not whole buckets; an unknown ``target``.
    """
    return _run(x, [scales, offsets], [], bits=bits, bucket=bucket, rounding="grid", output="pack", target=target)


def project(x, bits, bucket, rounding, key=None, bucket_ids=None, *, target):
    """``(qt.dequantize(), qt.scales, qt.offsets)`` of ``qt = qz.quantize(x, ...)``: the values
    on a fresh grid, and that grid, in one pass.

    Args:
      x: values ``(..., n)``, ``n`` a multiple of ``bucket`` (quantized as float32).
      bits: bits per code, 1..8 (2..8 with ``"shift"``).
      bucket: elements per (scale, offset) pair, a positive multiple of 8.
      rounding: ``"stochastic"``, ``"nearest"`` or ``"shift"`` (as ``qz.quantize``).
      key: the uint32 key of the randomness; required for ``"stochastic"`` and ``"shift"``.
      bucket_ids: uint32 ``(..., n // bucket)`` global ids of the buckets, the counters of the
        randomness; None (the default): the row-major ids of ``x`` itself.
      target: the Pallas lowering, one of ``_pallas.TARGETS``: ``"interpret"``, ``"triton"``
        (CUDA), ``"mosaic_tpu"`` or ``"tpu_interpret"`` (the TPU form in interpret mode; the TPU
        forms need a bucket that is a multiple of 128).

    Returns:
      A tuple ``(values, scales, offsets)`` of float32 ``(..., n)`` on the grid and float32
      ``(..., n // bucket)`` twice.

    Raises:
      ValueError: ``bits`` not in 1..8; ``bucket`` not a positive multiple of 8; a last axis that
        is not whole buckets; an unknown ``rounding`` or ``target``; ``"stochastic"`` /
        ``"shift"`` without a key; ``"shift"`` with ``bits < 2``.
    """
    row_aux, scalar_aux = _fresh_grid_aux(x, bits, bucket, rounding, key, bucket_ids)
    return _run(x, row_aux, scalar_aux, bits=bits, bucket=bucket, rounding=rounding, output="values", target=target)


def snap(x, scales, offsets, bits, bucket, *, target):
    """``qz.quantize_on_grid(x, scales, offsets, ...).dequantize()`` in one pass.

    ``x`` moved exactly onto a given grid (round to nearest, clipped to its levels).

    Args:
      x: values ``(..., n)``, ``n`` a multiple of ``bucket`` (read as float32).
      scales: float32 ``(..., n // bucket)``, the grid's step per bucket.
      offsets: float32 ``(..., n // bucket)``, the grid's lowest value per bucket.
      bits: bits per code, 1..8.
      bucket: elements per (scale, offset) pair, a positive multiple of 8.
      target: the Pallas lowering, one of ``_pallas.TARGETS``: ``"interpret"``, ``"triton"``
        (CUDA), ``"mosaic_tpu"`` or ``"tpu_interpret"`` (the TPU form in interpret mode; the TPU
        forms need a bucket that is a multiple of 128).

    Returns:
      The values on the grid, float32 ``(..., n)``.

    Raises:
      ValueError: ``bits`` not in 1..8; ``bucket`` not a positive multiple of 8; a last axis that
        is not whole buckets; an unknown ``target``.
    """
    return _run(x, [scales, offsets], [], bits=bits, bucket=bucket, rounding="grid", output="values", target=target)
