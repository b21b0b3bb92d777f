"""The wire format of one quantized buffer, and its receive side.

One uint8 payload per :class:`~qsdp_jax._src.quant.quantizers.QTensor`: ``[packed codes | scales bytes |
offsets bytes]`` (the stats as float32, or bfloat16 with ``stats_dtype="bfloat16"``), built by
:func:`to_payload` (or the Pallas packing through :func:`payload_kernels`) and read back by
:func:`from_payload`. :func:`dequantize_rows` dequantizes (and with ``summed`` sums, in the
order of :func:`sum_rows`) the payloads every sender sent. :func:`cpu_boundary` is the XLA:CPU
fusion boundary that keeps the payload build and the receive fast there. The collectives in
:mod:`qsdp_jax.collectives` move these payloads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax import lax

from qsdp_jax._src.quant import quantizers as qz


def payload_size(n: int, bits: int, bucket: int, stats_dtype: str = "float32") -> int:
    """Bytes of the payload of ``n`` elements: packed codes plus a scale and an offset per
    bucket (``stats_dtype``: float32, 8 bytes per bucket, or bfloat16, 4)."""
    return qz.packed_size(n, bits) + stat_bytes(stats_dtype) * (n // bucket)


def stat_bytes(stats_dtype: str) -> int:
    """Bytes of one bucket's (scale, offset) on the wire: 8 (float32) or 4 (bfloat16)."""
    if stats_dtype not in qz.STATS_DTYPES:
        raise ValueError(f"stats_dtype={stats_dtype!r} is invalid: must be one of {qz.STATS_DTYPES}")
    return 8 if stats_dtype == "float32" else 4


def cpu_boundary(fn, *args):
    """``fn(*args)``, compiled in kernels of its own on CPU; inline on GPU/TPU (the conditional's
    predicate is a constant there, folded by the compiler with the conditional).

    XLA:CPU fuses greedily, and two of its choices cost several times the work here: a
    quantizer fused into the packing loop recomputes codes with their per-bucket broadcasts
    for every output byte (the reduce-scatter of 8 x 3.3M elements took 60 ms at 4 bits and
    112 ms at 3 bits fused, 20 and 21 ms split), and a loop fusion loops over its *root's*
    shape, so a fusion ending in a flat ``(..., n)`` reshape of per-bucket work recomputes the
    bucket index and reloads the bucket's scale and offset for every vector of elements, where
    a root shaped ``(..., n // bucket, bucket)`` keeps them in registers over a bucket. XLA:CPU
    removes ``optimization_barrier`` before fusion, so the boundary is a ``lax.cond`` whose
    predicate is always true but read from the data (``(x | 1) != 0`` for the first element
    ``x`` of the first array argument, as an integer), so that XLA cannot fold the conditional away.
    Its other branch is zeros of ``fn``'s result shapes: one cheap kernel, where a second copy
    of ``fn`` (the earlier boundary, ``cond(p, fn, fn)``) compiled every kernel twice. Callers
    pass bucketed operands and let ``fn`` return bucketed results (:func:`payload_kernels`,
    :func:`dequantize_rows`). GPU/TPU fusions need none of this.
    """

    # fn traced once: its jaxpr is the taken branch, its result shapes the other's zeros
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    _, tree = jax.tree_util.tree_flatten(shapes)
    taken = lambda *x: jax.tree_util.tree_unflatten(tree, jax_core.jaxpr_as_fun(closed)(*x))  # noqa: E731
    zeros = lambda *x: jax.tree_util.tree_unflatten(tree, [_zeros_like(v) for v in closed.out_avals])  # noqa: E731
    first = jax.tree_util.tree_leaves(args)[0].reshape(-1)[0].astype(jnp.int32)
    # Only the predicate depends on the platform: elsewhere ``(f & 0) == 0``, true in a way the
    # compiler folds (with the conditional), and varying over the same manual axes as on CPU.
    # Platform-dependent branches (``split`` on CPU, ``fn`` inline elsewhere) put fn in the
    # module twice; a lowering for CPU carried both (W8G8 Gemma 3 270M: 7.6 s of lowering,
    # 6.2 now) through the first passes before the dead one was dropped.
    pred = lax.platform_dependent(first, cpu=lambda f: (f | 1) != 0, default=lambda f: (f & 0) == 0)
    return lax.cond(pred, taken, zeros, *jax.tree_util.tree_leaves(args))


def _zeros_like(aval) -> jax.Array:
    """Zeros of ``aval``'s shape and dtype, varying over the same manual mesh axes (inside a
    ``shard_map`` that checks them, a cond's branches must agree)."""
    z = jnp.zeros(aval.shape, aval.dtype)
    manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10 (ShapedArray.vma before it)
    vma = tuple(sorted(manual.varying)) if manual is not None else tuple(getattr(aval, "vma", ()) or ())
    return lax.pcast(z, vma, to="varying") if vma else z


def to_payload(qt: qz.QTensor, split: bool = False, stats_dtype: str = "float32") -> jax.Array:
    """QTensor (..., n) -> uint8 (..., payload_size(n)); ``split``: build it behind
    :func:`payload_kernels`."""
    if split:
        return payload_kernels(qt, stats_dtype)
    return payload_from_packed(qz.pack_bits(qt.codes, qt.bits), qt.scales, qt.offsets, stats_dtype)


def payload_kernels(qt: qz.QTensor, stats_dtype: str = "float32") -> jax.Array:
    """``to_payload(qt)`` behind :func:`cpu_boundary`, which receives the codes by bucket.

    The quantizer's fusion then ends in bucketed codes and the packing and the payload's
    assembly run in kernels of their own. Measured with ``experiments/bench_kernels.py``'s
    passes (4M elements, bucket 1024, 2 busy cores, CPU time): the 8-bit stochastic quantize +
    payload 5.2 -> 4.5 ms against a flat boundary-free build; the 4-bit weight grid pack 5.6 ->
    1.6 ms against the inline build. Same bytes. The all-gather uses it for packed codes only
    (an 8-bit grid payload is one fused pass without it).
    """
    lead, n = qt.codes.shape[:-1], qt.codes.shape[-1]

    def build(codes, scales, offsets):
        return payload_from_packed(qz.pack_bits(codes.reshape(*lead, n), qt.bits), scales, offsets, stats_dtype)

    return cpu_boundary(build, qz.to_buckets(qt.codes, qt.bucket), qt.scales, qt.offsets)


def pack_codes(qt: qz.QTensor) -> jax.Array:
    """``pack_bits(qt.codes)``; below 8 bits behind :func:`cpu_boundary`, which receives the codes
    by bucket (:func:`payload_kernels`' packing, without the payload around it)."""
    if qt.bits == 8:
        return qt.codes
    lead, n = qt.codes.shape[:-1], qt.codes.shape[-1]
    return cpu_boundary(lambda c: qz.pack_bits(c.reshape(*lead, n), qt.bits), qz.to_buckets(qt.codes, qt.bucket))


def payload_from_packed(
    packed: jax.Array, scales: jax.Array, offsets: jax.Array, stats_dtype: str = "float32"
) -> jax.Array:
    """``[packed codes | scales bytes | offsets bytes]``: the payload of already packed codes.

    ``stats_dtype="bfloat16"``: the stats are sent as bf16 (2 bytes each); they must already
    be bf16 values (``qz.quantize(..., stats_dtype="bfloat16")`` makes them so), so the cast
    is exact."""
    stats = jnp.concatenate([scales, offsets], axis=-1)  # one bitcast for both
    if stat_bytes(stats_dtype) == 4:
        stats = lax.bitcast_convert_type(stats.astype(jnp.bfloat16), jnp.uint16)
    stat_bytes_ = lax.bitcast_convert_type(stats, jnp.uint8).reshape(*stats.shape[:-1], -1)
    return jnp.concatenate([packed, stat_bytes_], axis=-1)


def split_payload(
    payload: jax.Array, n: int, bits: int, bucket: int, stats_dtype: str = "float32"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inverse of :func:`payload_from_packed`: ``(packed codes, scales, offsets)``, stats float32."""
    p = qz.packed_size(n, bits)
    nb = n // bucket
    lead = payload.shape[:-1]
    if payload.shape[-1] != payload_size(n, bits, bucket, stats_dtype):
        raise ValueError(
            f"payload of {payload.shape[-1]} bytes does not hold {n} codes of {bits} bits with {stats_dtype} stats"
        )
    if stat_bytes(stats_dtype) == 4:
        half = lax.bitcast_convert_type(payload[..., p:].reshape(*lead, 2 * nb, 2), jnp.uint16)
        stats = lax.bitcast_convert_type(half, jnp.bfloat16).astype(jnp.float32)
    else:
        stats = lax.bitcast_convert_type(payload[..., p:].reshape(*lead, 2 * nb, 4), jnp.float32)
    return payload[..., :p], stats[..., :nb], stats[..., nb:]


def from_payload(payload: jax.Array, n: int, bits: int, bucket: int, stats_dtype: str = "float32") -> qz.QTensor:
    """Inverse of :func:`to_payload`."""
    packed, scales, offsets = split_payload(payload, n, bits, bucket, stats_dtype)
    codes = qz.unpack_bits(packed, bits, n)
    return qz.QTensor(codes=codes, scales=scales, offsets=offsets, bits=bits, bucket=bucket)


def dequantize_rows(
    payloads: jax.Array, n: int, bits: int, bucket: int, summed: bool = False, stats_dtype: str = "float32"
) -> jax.Array:
    """The jnp receive: payloads ``(..., payload)`` of ``n`` elements each -> float32
    ``(..., n)``, or with ``summed`` the :func:`sum_rows` of the leading axis, ``(n,)``.

    Behind :func:`cpu_boundary`, whose branches return the values by bucket and by packing
    group (:func:`qz.unpack_groups`): the unpack + dequantize (+ sum) loop then holds each
    bucket's scale and offset in registers and reads contiguous bytes (4M elements, bucket
    1024, 2 busy cores, CPU time: the 8-bit sum of 8 chunks 2.9 -> 0.3 ms, 4-bit 4.5 -> 2.2
    ms with the bucketed boundary alone; the 8-bit gather 2.3 -> 0.8 ms; 4-bit 2.2 -> 0.6 ms and
    3-bit 4.5 -> 1.0 ms with the groups). Same bits as ``from_payload(...).dequantize()``.
    """

    def values(p):
        v = _bucketed_values(*split_payload(p, n, bits, bucket, stats_dtype), n, bits, bucket)
        return sum_rows(v) if summed else v  # (..., buckets, groups, codes per group)

    if bucket % 8:  # buckets that do not pack into whole bytes: the flat unpacking
        v = from_payload(payloads, n, bits, bucket, stats_dtype).dequantize()
        return sum_rows(v) if summed else v
    out = cpu_boundary(values, payloads)
    return out.reshape(*out.shape[:-3], n)


def _bucketed_values(packed, scales, offsets, n: int, bits: int, bucket: int) -> jax.Array:
    """``offset + code * scale`` of ``n`` packed codes, shaped ``(..., buckets, groups, codes per
    group)`` (:func:`qz.unpack_groups`)."""
    codes = qz.unpack_groups(packed.reshape(*packed.shape[:-1], n // bucket, -1), bits)
    return offsets[..., None, None] + codes.astype(jnp.float32) * scales[..., None, None]


def dequantize_parts(packed: jax.Array, scales: jax.Array, offsets: jax.Array, n: int, bits: int, bucket: int):
    """The jnp receive of split parts: packed codes ``(..., packed_size(n))`` and their stats
    ``(..., n // bucket)`` -> float32 ``(..., n)``, behind :func:`cpu_boundary` as
    :func:`dequantize_rows` (same bits); ``bucket`` a multiple of 8."""
    out = cpu_boundary(lambda p, s, o: _bucketed_values(p, s, o, n, bits, bucket), packed, scales, offsets)
    return out.reshape(*out.shape[:-3], n)


def sum_rows(parts: jax.Array) -> jax.Array:
    """Sum ``parts`` (N, ...) over its leading axis by pairwise halving.

    The same sum as ``jnp.sum(parts, axis=0)`` up to the order of the additions (pairwise, which
    is at least as accurate), but each level is one elementwise add of two contiguous halves.
    XLA:CPU lowers a reduction over the *major* axis of a fused producer to a strided loop that
    was measured 3-4x slower than the whole quantize + dequantize around it (8 x 3.3M elements:
    88 ms against 27 ms with this).
    """
    while parts.shape[0] > 1:
        n = parts.shape[0]
        half = n // 2
        summed = parts[:half] + parts[half : 2 * half]
        parts = jnp.concatenate([summed, parts[2 * half :]], axis=0) if n % 2 else summed
    return parts[0]
