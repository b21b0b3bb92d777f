"""A shard to its quantized payload and the gathered payloads back to floats, through the kernels
``QSDPConfig.kernels`` selects (:func:`qsdp_jax.kernels.select`: the jnp reference or Pallas).

The payload layout itself (codes, then the stats bytes) is :mod:`qsdp_jax._src.quant.payload`;
:func:`qsdp_jax.collectives.quantized_all_gather` and the two-level gathers of
:mod:`qsdp_jax._src.collective.hierarchy` move what :func:`quantize_payload` builds and
:func:`dequantize_payloads` reads.
"""

from __future__ import annotations

from qsdp_jax import kernels as qk
from qsdp_jax._src.quant import quantizers as qz
from qsdp_jax._src.quant.payload import (
    dequantize_parts,
    dequantize_rows,
    payload_from_packed,
    split_payload,
    to_payload,
)


def stats_kernels(kernels: str, stats_dtype: str) -> str:
    """The kernels mode for quantizers that compute their own stats: the Pallas kernels write
    float32 stats only, so compact (bf16) stats fall back to the jnp reference."""
    return kernels if stats_dtype == "float32" else "reference"


def quantize_payload(
    shard, *, bits, bucket, grid=None, rounding="nearest", key=None, kernels="auto", stats_dtype="float32"
):
    """The uint8 payload of a 1-D shard (codes + per-bucket stats bytes, :func:`to_payload`'s
    layout): on ``grid`` when given (lossless), else quantized with ``rounding``."""
    sd = stats_dtype
    if grid is not None:
        return qk.select(
            kernels,
            lambda x, s, o: to_payload(qz.quantize_on_grid(x, s, o, bits, bucket), split=bits < 8, stats_dtype=sd),
            lambda x, s, o, target: payload_from_packed(qk.grid_pack(x, s, o, bits, bucket, target=target), s, o, sd),
            shard,
            grid[0],
            grid[1],
            bucket=bucket,
        )
    return qk.select(
        stats_kernels(kernels, sd),
        lambda x: to_payload(
            qz.quantize(x, bits, bucket, rounding, key, stats_dtype=sd), split=bits < 8, stats_dtype=sd
        ),
        lambda x, target: payload_from_packed(*qk.quantize_pack(x, bits, bucket, rounding, key, target=target)),
        shard,
        bucket=bucket,
    )


def dequantize_payloads(payloads, n, *, bits, bucket, kernels="auto", stats_dtype="float32"):
    """``(senders, payload)`` uint8 rows of ``n`` elements each -> the float32 concatenation."""
    sd = stats_dtype
    return qk.select(
        kernels,
        lambda p: dequantize_rows(p, n, bits, bucket, stats_dtype=sd).reshape(-1),
        lambda p, target: qk.unpack_dequantize(
            *split_payload(p, n, bits, bucket, sd), bits, bucket, n, target=target
        ).reshape(-1),
        payloads,
        bucket=bucket,
    )


def dequantize_spans(payloads, n, spans, *, bits, bucket, kernels="auto", stats_dtype="float32") -> tuple:
    """``(senders, payload)`` uint8 rows of ``n`` elements each -> for each ``(offset, size)`` of
    ``spans`` (offsets whole buckets) the float32 ``(senders, size)`` piece of every sender's
    values: what ``dequantize_payloads(...)`` holds at those places, decoded straight into the
    pieces (no full float buffer)."""
    packed, scales, offsets = split_payload(payloads, n, bits, bucket, stats_dtype)
    out = []
    for o, size in spans:
        m = -(-size // bucket) * bucket  # the piece's whole buckets
        parts = (
            packed[..., qz.packed_size(o, bits) : qz.packed_size(o + m, bits)],
            scales[..., o // bucket : (o + m) // bucket],
            offsets[..., o // bucket : (o + m) // bucket],
        )
        values = qk.select(
            kernels,
            lambda p, s, f, m=m: dequantize_parts(p, s, f, m, bits, bucket),
            lambda p, s, f, target, m=m: qk.unpack_dequantize(p, s, f, bits, bucket, m, target=target),
            *parts,
            bucket=bucket,
        )
        out.append(values[..., :size])
    return tuple(out)
