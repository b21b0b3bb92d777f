"""Shared pieces of the Pallas kernels: targets, block sizes, the ``pallas_call`` builder, and
the in-kernel arithmetic that must give the jnp reference's bits on every backend.

Data layout in every kernel: a bucketed float32 buffer ``(rows, bucket)`` is viewed, for free
(row-major reshape), as ``(rows, bucket // 8, 8)``: one row per bucket, one group of 8
consecutive elements per middle index. Column ``k`` (``ref[:, :, k]``, shape ``(rows, G)``)
holds element ``k`` of every group, so the 8 -> ``bits`` bytes of a group are elementwise
combinations of the 8 columns and land in column ``j`` of a ``(rows, G, bits)`` uint8 output,
which is exactly :func:`qsdp_jax._src.quant.quantizers.pack_bits`'s byte layout. Kernels never reshape
in-kernel values, do all bit work in uint32 and reduce only over the last axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from qsdp_jax._src.quant import quantizers as qz

TARGETS = ("interpret", "triton", "mosaic_tpu", "tpu_interpret")
# The targets that use the TPU's lane-dense layout (``_tpu``): Mosaic itself, and the same
# kernels in interpret mode (how tests on a CPU check their bits).
TPU_LAYOUT = ("mosaic_tpu", "tpu_interpret")

# Elements per kernel instance (one grid step): registers on GPU, VMEM on TPU, and as many as
# possible in interpret mode, where each grid step costs about half a millisecond.
# The TPU layout: 256 KiB of float32, which with the double buffering, the scratch and the
# temporaries stays far inside every generation's scoped VMEM (16 MiB on v4/v5e, 32 MiB on
# v5p/v6e), in a multiple of 32 buckets (8-bit tiles are 32 sublanes).
_BLOCK_ELEMS = {"interpret": 1 << 21, "triton": 4096, "mosaic_tpu": 1 << 16, "tpu_interpret": 1 << 16}


def check_target(target: str, bucket: int | None = None):
    if target not in TARGETS:
        raise ValueError(f"kernel target {target!r} is invalid: must be one of {TARGETS}")
    if bucket is not None and target in TPU_LAYOUT and not tpu_ok(bucket):
        raise ValueError(f"bucket={bucket} does not suit the TPU kernels ({target!r}): they need a multiple of 128")


def tpu_ok(bucket: int) -> bool:
    """The TPU layout needs whole 128-lane chunks: ``bucket % 128 == 0``."""
    return bucket % 128 == 0


def triton_ok(bucket: int) -> bool:
    """Triton needs power-of-2 tensors: the bucket's group count ``bucket // 8`` must be one."""
    g = bucket // 8
    return g >= 1 and g & (g - 1) == 0


def row_block(rows: int, bucket: int, target: str) -> int:
    """Buckets per grid step for ``target`` (a power of 2 on Triton; the TPU layout has its own)."""
    rb = max(1, _BLOCK_ELEMS[target] // bucket)
    if target in TPU_LAYOUT:
        rb = max(32, rb // 32 * 32)
    if target == "triton":
        rb = 1 << (rb.bit_length() - 1)
        return min(rb, pl.next_power_of_2(rows))
    return min(rb, rows)


def _compiler_params(target: str):
    if target == "triton":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=1)
    if target == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",))
    return None


def rows_spec(rb: int, tail: tuple[int, ...], lead: tuple[int, ...] = ()) -> pl.BlockSpec:
    """Block ``lead + (rb,) + tail`` of an array ``lead + (rows,) + tail``, stepping over rows."""
    nl, nt = len(lead), len(tail)
    return pl.BlockSpec(lead + (rb,) + tail, lambda i: (0,) * nl + (i,) + (0,) * nt)


def scalar_spec() -> pl.BlockSpec:
    """A ``(1, 1)`` array (a key) seen whole by every grid step."""
    return pl.BlockSpec((1, 1), lambda i: (0, 0))


def call(kernel, out_shape, in_specs, out_specs, *, rows: int, rb: int, target: str, name: str, scratch=None):
    """``pl.pallas_call`` over a 1-D grid of row blocks, with ``target``'s compiler params and,
    given its shape, one float32 VMEM ``scratch`` buffer (the kernel's last argument; TPU only).

    Returns a function of the input arrays. The outputs vary over the same manual mesh axes as
    the first input, so the call also type-checks inside ``shard_map(check_vma=True)``.
    """
    check_target(target)

    def run(*args):
        mat = jax.typeof(args[0]).manual_axis_type
        shapes = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=mat), out_shape)
        return pl.pallas_call(
            kernel,
            out_shape=shapes,
            grid=(pl.cdiv(rows, rb),),
            in_specs=in_specs,
            out_specs=out_specs,
            compiler_params=_compiler_params(target),
            scratch_shapes=() if scratch is None else (_vmem(scratch),),
            interpret=target in ("interpret", "tpu_interpret"),
            name=name,
        )(*args)

    return run


def _vmem(shape):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.VMEM(shape, jnp.float32)


# ----------------------------------------------------------------------------------------------
# In-kernel arithmetic (identical bits to the jnp reference)
# ----------------------------------------------------------------------------------------------
def _asm(op: str, a, b):
    from jax.experimental.pallas import triton as pltriton

    a, b = jnp.broadcast_arrays(a, b)
    (out,) = pltriton.elementwise_inline_asm(
        f"{op} $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def fdiv(a, b, target: str):
    """IEEE ``a / b``. Triton lowers ``/`` to the approximate ``div.full.f32``: use ``div.rn``.

    Products are kept from contracting into an FMA with the add that follows exactly as in
    the reference (``qz.unfused``).
    """
    if target == "triton":
        return _asm("div.rn.f32", a, b)
    return a / b


def round_even(t):
    """``jnp.round`` (half to even) for ``0 <= t < 2**23`` (callers clip first), from floor:
    ``t - floor(t)`` is exact there, so the tie test is exact (Triton has no round primitive,
    and ``(t + 2**23) - 2**23`` is folded to ``t`` by XLA's simplifier)."""
    r = jnp.floor(t)
    d = t - r
    odd = (r.astype(jnp.int32) & 1) == 1
    up = (d > 0.5) | ((d == 0.5) & odd)
    return jnp.where(up, r + 1.0, r)


def uniform(h):
    """``qz.hash_uniform``'s float from the hash ``h``: the top 24 bits times 2**-24 (through
    int32, since unsigned-to-float conversion is not available everywhere)."""
    top = lax.bitcast_convert_type(h >> jnp.uint32(8), jnp.int32)
    return top.astype(jnp.float32) * jnp.float32(2.0**-24)


def round_scale_up(s):
    """``qz.round_scale_up`` written with the ops every kernel backend has."""
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    bits = (bits + jnp.uint32(0xFF)) & jnp.uint32(0xFFFFFF00)
    up = lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where((s > 0) & (s < jnp.float32(jnp.inf)), up, s)


def inverse(s, target: str):
    """``qz._inverse``: ``1 / s``, and 0 where ``s == 0``."""
    safe = jnp.where(s == 0, jnp.float32(1.0), s)
    return jnp.where(s == 0, jnp.float32(0.0), fdiv(jnp.float32(1.0), safe, target))


def to_u32(q):
    """Float codes in [0, 255] -> uint32."""
    return lax.bitcast_convert_type(q.astype(jnp.int32), jnp.uint32)


def to_f32(c):
    """uint32 codes in [0, 255] -> float32."""
    return lax.bitcast_convert_type(c, jnp.int32).astype(jnp.float32)


def pairwise_sum(parts: list):
    """``payload.sum_rows`` on a list: the same additions in the same order."""
    while len(parts) > 1:
        half = len(parts) // 2
        summed = [parts[i] + parts[half + i] for i in range(half)]
        parts = summed + parts[2 * half :]
    return parts[0]


def _or_all(xs):
    return functools.reduce(jnp.bitwise_or, xs)


def pack_columns(codes: list, bits: int) -> list:
    """8 uint32 code columns -> ``bits`` uint32 byte columns in ``qz.pack_bits``'s layout."""
    if bits == 8:
        return codes
    if 8 % bits == 0:
        per = 8 // bits
        return [_or_all([codes[m * per + i] << jnp.uint32(i * bits) for i in range(per)]) for m in range(bits)]
    one = jnp.uint32(1)
    return [_or_all([((c >> jnp.uint32(j)) & one) << jnp.uint32(k) for k, c in enumerate(codes)]) for j in range(bits)]


def unpack_columns(byte_cols: list, bits: int) -> list:
    """Inverse of :func:`pack_columns`: ``bits`` uint32 byte columns -> 8 uint32 code columns."""
    if bits == 8:
        return byte_cols
    if 8 % bits == 0:
        per, mask = 8 // bits, jnp.uint32((1 << bits) - 1)
        return [(byte_cols[k // per] >> jnp.uint32((k % per) * bits)) & mask for k in range(8)]
    one = jnp.uint32(1)
    return [_or_all([((b >> jnp.uint32(k)) & one) << jnp.uint32(j) for j, b in enumerate(byte_cols)]) for k in range(8)]


def check_bits_bucket(bits: int, bucket: int):
    qz._check_bits(bits)
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 8 or bucket % 8:
        raise ValueError(f"bucket={bucket!r} is invalid: must be a positive multiple of 8")
