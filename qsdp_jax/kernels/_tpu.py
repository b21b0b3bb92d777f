"""The Mosaic TPU form of the kernels: lane-dense blocks, bytes packed and unpacked on the MXU.

The Triton/interpret kernels view a bucket as ``(bucket // 8, 8)`` groups and read element
``k`` of every group as a column. On a TPU that last axis of 8 is padded to 128 lanes in VMEM
(16x: ``CompileTimeScopedVmemOom`` on v5e/v5p/v6e) and reading a column is a lane gather (v4:
``Sublane gather not supported by this TPU generation``). Here a row of buckets is viewed, for
free, as ``(rows * m, 128)`` with ``m = bucket // 128`` lane-dense chunks per bucket, and chunk
``s`` of every bucket in a block is read with one strided sublane load. Element ``e = 128 s +
l`` of a bucket sits in lane ``l``; its group is ``e // 8``, its place in the group ``l % 8``.

Packing ``8`` codes of a group into ``bits`` bytes (``qz.pack_bits``'s layout) moves values
between lanes. It is linear in the codes (1, 2, 4 bits: ``byte = sum code * 2**(i * bits)``)
or in their bit planes (3, 5, 6, 7 bits), with 0/1/power-of-2 coefficients, so it is a matmul
by a constant ``(128, 16 * bits)`` matrix; unpacking is the transpose's replication followed by
lane-dependent shifts. Codes, bits and coefficients are integers below 256, exact in bfloat16,
and every output sums at most 8 of them, exact in the float32 accumulator: the bytes are those
of ``qz.pack_bits`` bit for bit. The arithmetic around them is ``_pallas``'s, so the values,
grids and codes are the reference's bits too (tested in interpret mode, compiled by libtpu).

A bucket must be a multiple of 128 here (``_pallas.tpu_ok``); other buckets use the jnp reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from qsdp_jax._src.quant import quantizers as qz
from qsdp_jax.kernels import _pallas as kp

LANES = 128


def _lane():
    return lax.broadcasted_iota(jnp.int32, (1, LANES), 1)


def _div(a, p: int):
    """``a // p`` for ``a >= 0`` and a power of 2 ``p``, as a shift: jnp's floor division of
    signed integers takes a ``sign``, whose Mosaic lowering asks the device for its generation
    (and fails when lowered from a CPU host by ``jax.export``)."""
    return jnp.right_shift(a, p.bit_length() - 1)


def _mod(a, p: int):
    """``a % p`` for ``a >= 0`` and a power of 2 ``p``, as a mask (see :func:`_div`)."""
    return a & (p - 1)


def _pack_matrix(bits: int, plane: int | None):
    """``(128, 16 * bits)`` bfloat16: chunk codes (or bit plane ``plane``) -> the chunk's bytes."""
    width = 16 * bits
    lane = lax.broadcasted_iota(jnp.int32, (LANES, width), 0)
    col = lax.broadcasted_iota(jnp.int32, (LANES, width), 1)
    if plane is None:  # 1, 2, 4 bits: code l is bits [(l % per) * bits, ...) of byte l // per
        per = 8 // bits
        hit = _div(lane, per) == col
        weight = jnp.left_shift(jnp.int32(1), _mod(lane, per) * bits)
    else:  # bit plane j of code l is bit l % 8 of byte (l // 8) * bits + j
        hit = _div(lane, 8) * bits + plane == col
        weight = jnp.left_shift(jnp.int32(1), _mod(lane, 8))
    return jnp.where(hit, weight, 0).astype(jnp.bfloat16)


def _spread_matrix(bits: int, plane: int | None):
    """``(16 * bits, 128)`` bfloat16 0/1: lane ``l`` receives the byte that holds its code (or
    its bit plane ``plane``)."""
    width = 16 * bits
    row = lax.broadcasted_iota(jnp.int32, (width, LANES), 0)
    lane = lax.broadcasted_iota(jnp.int32, (width, LANES), 1)
    src = _div(lane, 8 // bits) if plane is None else _div(lane, 8) * bits + plane
    return (row == src).astype(jnp.bfloat16)


def _matmul(a, b):
    return jnp.dot(a.astype(jnp.bfloat16), b, preferred_element_type=jnp.float32)


def pack_chunk(codes, bits: int):
    """uint32 codes ``(r, 128)`` -> uint8 bytes ``(r, 16 * bits)`` in ``qz.pack_bits``'s layout."""
    if bits == 8:
        return codes.astype(jnp.uint8)
    if 8 % bits == 0:
        packed = _matmul(kp.to_f32(codes), _pack_matrix(bits, None))
    else:
        one = jnp.uint32(1)
        planes = [kp.to_f32((codes >> jnp.uint32(j)) & one) for j in range(bits)]
        packed = sum(_matmul(p, _pack_matrix(bits, j)) for j, p in enumerate(planes))
    return packed.astype(jnp.int32).astype(jnp.uint8)


def unpack_chunk(byte_block, bits: int):
    """uint8 bytes ``(r, 16 * bits)`` -> uint32 codes ``(r, 128)`` (inverse of :func:`pack_chunk`)."""
    b = byte_block.astype(jnp.int32)
    if bits == 8:
        return lax.bitcast_convert_type(b, jnp.uint32)
    lane, bf = _lane(), b.astype(jnp.float32)
    if 8 % bits == 0:
        per = 8 // bits
        spread = _matmul(bf, _spread_matrix(bits, None)).astype(jnp.int32)
        code = jnp.right_shift(spread, _mod(lane, per) * bits) & ((1 << bits) - 1)
    else:
        code = jnp.zeros((b.shape[0], LANES), jnp.int32)
        for j in range(bits):
            spread = _matmul(bf, _spread_matrix(bits, j)).astype(jnp.int32)
            code = code | ((jnp.right_shift(spread, _mod(lane, 8)) & 1) << j)
    return lax.bitcast_convert_type(code, jnp.uint32)


def _chunk(ref, s: int, m: int, rb: int):
    """Chunk ``s`` of every bucket of the block: rows ``s, s + m, ...`` of ``ref`` (a strided
    load, 32-bit data only)."""
    return ref[pl.ds(s, rb, stride=m), :]


def _repeat(scratch, v, m: int, rb: int):
    """``(rb, 1)`` per-bucket values -> ``(rb * m, 128)``: each bucket's value on its ``m`` rows."""
    full = jnp.broadcast_to(v, (rb, LANES))
    if m == 1:
        return full
    for s in range(m):
        scratch[pl.ds(s, rb, stride=m), :] = full
    return scratch[...]


def _quantize_kernel(*refs, bits, m, rb, rounding, output, target):
    """Inputs: x ``(rb * m, 128)``, then stochastic (key (1, 1), each row's first counter
    ``(rb * m, 1)``), shift (xi ``(rb, 1)``), grid (scales, offsets ``(rb * m, 1)``) or nothing.
    Outputs: bytes ``(rb * m, 16 * bits)`` or values ``(rb * m, 128)``, then scales and offsets
    ``(rb, 1)`` unless the grid was given; last, a float32 ``(rb * m, 128)`` scratch."""
    x_ref, *rest = refs
    n_in = {"stochastic": 2, "shift": 1, "grid": 2, "nearest": 0}[rounding]
    aux, outs, scratch = rest[:n_in], rest[n_in:-1], rest[-1]
    top = qz.levels(bits)
    if rounding == "grid":
        scale, off = aux[0][...], aux[1][...]
    else:
        chunks = [_chunk(x_ref, s, m, rb) for s in range(m)]
        lo = jnp.min(functools.reduce(jnp.minimum, chunks), axis=1, keepdims=True)
        hi = jnp.max(functools.reduce(jnp.maximum, chunks), axis=1, keepdims=True)
        scale = kp.round_scale_up(qz.per_interval(hi - lo, top - 1 if rounding == "shift" else top))
        off = lo
        if rounding == "shift":
            off = jnp.where(scale == 0, lo, lo - qz.unfused(aux[0][...] * scale, scale))
        outs[1][...] = scale
        outs[2][...] = off
        scale, off = _repeat(scratch, scale, m, rb), _repeat(scratch, off, m, rb)
    t = (x_ref[...] - off) * kp.inverse(scale, target)
    if rounding == "stochastic":
        u = kp.uniform(qz.mix32(qz.mix32(aux[1][...] + lax.bitcast_convert_type(_lane(), jnp.uint32)) ^ aux[0][...]))
        q = jnp.clip(jnp.floor(qz.unfused(t, u) + u), 0.0, float(top))
    else:
        q = kp.round_even(jnp.clip(t, 0.0, float(top)))
    outs[0][...] = off + q * scale if output == "values" else pack_chunk(kp.to_u32(q), bits)


def _spread_rows(v, m: int):
    """``(rows, 1)`` -> ``(rows * m, 1)``: each bucket's value on each of its chunks' rows."""
    return jnp.repeat(v, m, axis=0) if m > 1 else v


def quantize(x, per_row, scalars, *, bits, bucket, rounding, output, target):
    """The TPU kernel over ``x`` float32 ``(rows, bucket)``, with ``(1, 1)`` ``scalars`` (a key)
    and ``(rows, 1)`` ``per_row`` values (``quantize._run``'s kernel inputs).

    Returns the packed bytes ``(rows, bucket * bits // 8)`` or the values ``(rows, bucket)``,
    then ``(rows, 1)`` scales and offsets unless ``rounding == "grid"``.
    """
    rows, m = x.shape[0], bucket // LANES
    rb = kp.row_block(rows, bucket, target)
    if rounding == "stochastic":  # each chunk row's first counter: its bucket's, plus 128 per chunk
        first = jnp.arange(m, dtype=jnp.uint32) * jnp.uint32(LANES)
        per_row = [(per_row[0] + first[None, :]).reshape(rows * m, 1)]
    elif rounding == "grid":
        per_row = [_spread_rows(v, m) for v in per_row]
    row_specs = [_rows(rb * m if rounding != "shift" else rb, 1)] * len(per_row)
    width = LANES if output == "values" else 16 * bits
    dtype = jnp.float32 if output == "values" else jnp.uint8
    out_shape = [jax.ShapeDtypeStruct((rows * m, width), dtype)]
    out_specs = [_rows(rb * m, width)]
    if rounding != "grid":
        out_shape += [jax.ShapeDtypeStruct((rows, 1), jnp.float32)] * 2
        out_specs += [_rows(rb, 1)] * 2
    kernel = functools.partial(_quantize_kernel, bits=bits, m=m, rb=rb, rounding=rounding, output=output, target=target)
    name = f"qsdp_{'project' if output == 'values' else 'quantize_pack'}_{rounding}_{bits}b"
    res = kp.call(
        kernel, tuple(out_shape), [_rows(rb * m, LANES)] + [kp.scalar_spec()] * len(scalars) + row_specs,
        tuple(out_specs), rows=rows, rb=rb, target=target, name=name, scratch=(rb * m, LANES),
    )(x.reshape(rows * m, LANES), *scalars, *per_row)  # fmt: skip
    main = res[0].reshape(rows, -1)
    return main if rounding == "grid" else (main, res[1], res[2])


def _dequantize_kernel(p_ref, s_ref, o_ref, out_ref, *, bits, num):
    views = [(p_ref.at[c], s_ref.at[c], o_ref.at[c]) for c in range(num)] if num else [(p_ref, s_ref, o_ref)]
    parts = [o[...] + kp.to_f32(unpack_chunk(p[...], bits)) * sc[...] for p, sc, o in views]
    out_ref[...] = kp.pairwise_sum(parts)


def dequantize(packed, scales, offsets, *, bits, bucket, num, target):
    """The TPU kernel: bytes ``([num,] rows, bucket * bits // 8)`` with ``([num,] rows, 1)``
    scales and offsets -> float32 ``(rows, bucket)``, summed over ``num`` chunks (pairwise, in
    ``payload.sum_rows``'s order) when ``num`` is given."""
    rows, m = packed.shape[-2], bucket // LANES
    if num and not sum_fits(num, bucket):
        most = SUM_BLOCK_ELEMS // (_tile(bucket) * bucket)
        raise ValueError(
            f"the TPU kernel qsdp_unpack_dequantize_sum_{bits}b cannot sum {num} senders' chunks of "
            f"{bucket}-element buckets within one grid step's scoped VMEM (at most {most}): use "
            "QSDPConfig(kernels='reference'), or a two-level mesh with fewer devices on each axis "
            "(the train step's dispatch sums with the reference there)"
        )
    rb = sum_row_block(rows, bucket, num, target) if num else kp.row_block(rows, bucket, target)
    lead = (num,) if num else ()
    specs = [_rows(rb * m, 16 * bits, lead), _rows(rb * m, 1, lead), _rows(rb * m, 1, lead)]
    kernel = functools.partial(_dequantize_kernel, bits=bits, num=num)
    name = f"qsdp_unpack_dequantize{'_sum' if num else ''}_{bits}b"
    out_shape = jax.ShapeDtypeStruct((rows * m, LANES), jnp.float32)
    stats = [_spread_rows(v.reshape(-1, 1), m).reshape(*lead, rows * m, 1) for v in (scales, offsets)]
    out = kp.call(kernel, out_shape, specs, _rows(rb * m, LANES), rows=rows, rb=rb, target=target, name=name)(
        packed.reshape(*lead, rows * m, 16 * bits), *stats
    )
    return out.reshape(rows, bucket)


# Elements of all senders' chunks in one grid step of the sum: 8 senders x 64 buckets of 1024
# compiled (v5e, v5p: about 9 MB of scoped VMEM); 16 senders x 64 needed 18.5 MB and failed
# against v5p's 16 MB limit (CompileTimeScopedVmemOom).
SUM_BLOCK_ELEMS = 1 << 19


def _tile(bucket: int) -> int:
    """The fewest buckets of a block: a whole 32-sublane tile of the ``(rows * m, 128)`` view
    (``m = bucket // 128`` rows a bucket)."""
    return 32 // math.gcd(32, bucket // LANES)


def sum_fits(num: int, bucket: int) -> bool:
    """Whether the sum over ``num`` senders fits :data:`SUM_BLOCK_ELEMS` with its smallest block
    (up to 128 senders for buckets of 128 or 1024)."""
    return _tile(bucket) * bucket * num <= SUM_BLOCK_ELEMS


def sum_row_block(rows: int, bucket: int, num: int, target: str) -> int:
    """Buckets per grid step of the sum over ``num`` senders: :func:`_pallas.row_block`'s, fewer
    where all senders' chunks would pass :data:`SUM_BLOCK_ELEMS`, in whole tiles (:func:`_tile`)."""
    tile = _tile(bucket)
    fit = max(tile, SUM_BLOCK_ELEMS // (bucket * num) // tile * tile)
    return min(kp.row_block(rows, bucket, target), fit, rows)


def _rows(rb: int, width: int, lead: tuple[int, ...] = ()) -> pl.BlockSpec:
    return kp.rows_spec(rb, (width,), lead)
