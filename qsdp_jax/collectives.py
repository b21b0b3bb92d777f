"""Collectives over the FSDP mesh axis, to be called inside ``jax.shard_map``.

* :func:`quantized_all_gather`: quantize + pack the local shard, ``all_gather`` one uint8
  buffer (packed codes, then the per-bucket scales and offsets as bytes), unpack and dequantize
  every sender's part. With a ``grid`` (QSDP mode) the shard is already on that grid and the
  gather is lossless: every device gets the owner's float32 values bit for bit.
* :func:`quantized_reduce_scatter`: each device quantizes its full gradient as N chunks (chunk
  ``i`` for device ``i``), ``all_to_all`` of the packed bytes, then dequantize and sum the N
  received chunks in float32. (An integer ``psum_scatter`` cannot do this: every sender has its
  own scales, and the sum would widen to s32 on the wire.)
* :func:`all_gather_fp`, :func:`reduce_scatter_fp`: the same ops in float32 or bfloat16, the
  baselines everything is compared against.
* :func:`make_gather`: the ``custom_vjp`` that pairs a gather (forward) with a reduce-scatter
  of the cotangent (backward); the backward returns the *sum* over devices.

Shards are 1-D with a length that is a multiple of the bucket size; full buffers are the N
shards concatenated in device order. The payload format (packed codes, then the stats) and its
receive side live in :mod:`qsdp_jax._src.payload`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from qsdp_jax import kernels as qk
from qsdp_jax._src import quantizers as qz
from qsdp_jax._src import rotation as qr
from qsdp_jax._src.payload import (  # noqa: F401  (the wire format; re-exported for callers of collectives)
    cpu_boundary,
    dequantize_rows,
    from_payload,
    payload_from_packed,
    payload_kernels,
    payload_size,
    split_payload,
    stat_bytes,
    sum_rows,
    to_payload,
)


# ----------------------------------------------------------------------------------------------
# All-gather
# ----------------------------------------------------------------------------------------------
def quantized_all_gather(
    shard: jax.Array,
    *,
    bits: int,
    bucket: int,
    axis_name: str,
    grid: tuple[jax.Array, jax.Array] | None = None,
    rounding: qz.QRounding = "nearest",
    key: jax.Array | None = None,
    kernels: str = "auto",
    stats_dtype: str = "float32",
) -> jax.Array:
    """Gather a 1-D shard from every device on ``axis_name``, quantized on the wire.

    Args:
      grid: ``(scales, offsets)`` of a grid the shard already lies on (QSDP mode); the codes are
        recovered exactly and the result equals the plain gather bit for bit.
      rounding, key: how to quantize when no grid is given (``"nearest"``: ZeRO++-style).
      kernels: ``QSDPConfig.kernels``: who quantizes + packs and unpacks + dequantizes
        (:func:`qsdp_jax.kernels.select`).
      stats_dtype: ``QSDPConfig.stats_dtype``: per-bucket stats on the wire as float32 or bf16
        (a ``grid`` must then hold bf16 values).
    Returns the float32 full buffer, ``axis_size * len(shard)`` elements.
    """
    n = shard.shape[-1]
    payload = quantize_payload(shard, bits=bits, bucket=bucket, grid=grid, rounding=rounding,
                               key=key, kernels=kernels, stats_dtype=stats_dtype)
    gathered = lax.all_gather(payload, axis_name, axis=0, tiled=False)  # (N, payload)
    return dequantize_payloads(gathered, n, bits=bits, bucket=bucket, kernels=kernels, stats_dtype=stats_dtype)


def stats_kernels(kernels: str, stats_dtype: str) -> str:
    """The kernels mode for quantizers that compute their own stats: the Pallas kernels write
    float32 stats only, so compact (bf16) stats fall back to the jnp reference."""
    return kernels if stats_dtype == "float32" else "reference"


def quantize_payload(shard, *, bits, bucket, grid=None, rounding="nearest", key=None, kernels="auto",
                     stats_dtype="float32"):
    """The uint8 payload of a 1-D shard (codes + per-bucket stats bytes, :func:`to_payload`'s
    layout): on ``grid`` when given (lossless), else quantized with ``rounding``."""
    sd = stats_dtype
    if grid is not None:
        return qk.select(
            kernels,
            lambda x, s, o: to_payload(qz.quantize_on_grid(x, s, o, bits, bucket), split=bits < 8, stats_dtype=sd),
            lambda x, s, o, target: payload_from_packed(
                qk.grid_pack(x, s, o, bits, bucket, target=target), s, o, sd),
            shard, grid[0], grid[1], bucket=bucket,
        )
    return qk.select(
        stats_kernels(kernels, sd),
        lambda x: to_payload(qz.quantize(x, bits, bucket, rounding, key, stats_dtype=sd), split=bits < 8,
                             stats_dtype=sd),
        lambda x, target: payload_from_packed(*qk.quantize_pack(x, bits, bucket, rounding, key, target=target)),
        shard, bucket=bucket,
    )


def dequantize_payloads(payloads, n, *, bits, bucket, kernels="auto", stats_dtype="float32"):
    """``(senders, payload)`` uint8 rows of ``n`` elements each -> the float32 concatenation."""
    sd = stats_dtype
    return qk.select(
        kernels,
        lambda p: dequantize_rows(p, n, bits, bucket, stats_dtype=sd).reshape(-1),
        lambda p, target: qk.unpack_dequantize(
            *split_payload(p, n, bits, bucket, sd), bits, bucket, n, target=target).reshape(-1),
        payloads, bucket=bucket,
    )


def all_gather_fp(shard: jax.Array, *, axis_name: str, dtype: str = "float32") -> jax.Array:
    """Plain all-gather in float32 or bfloat16 (weights cast for the wire); float32 result.

    bfloat16 travels bitcast to uint16: XLA's CPU backend otherwise widens bf16 collectives to
    f32, and the bytes on the wire would not be the ones the baseline claims.
    """
    if dtype == "float32":
        return lax.all_gather(shard.astype(jnp.float32), axis_name, axis=0, tiled=True)
    wire = lax.bitcast_convert_type(shard.astype(jnp.bfloat16), jnp.uint16)
    got = lax.all_gather(wire, axis_name, axis=0, tiled=True)
    return lax.bitcast_convert_type(got, jnp.bfloat16).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Reduce-scatter
# ----------------------------------------------------------------------------------------------
def quantized_reduce_scatter(
    full: jax.Array,
    *,
    bits: int,
    bucket: int,
    axis_name: str,
    key: jax.Array,
    rounding: qz.QRounding = "stochastic",
    kernels: str = "auto",
    rotation: int | None = None,
    stats_dtype: str = "float32",
) -> jax.Array:
    """Sum a 1-D buffer over ``axis_name`` and keep this device's chunk, quantized on the wire.

    ``full`` has ``N * chunk`` elements, ``chunk`` a multiple of ``bucket``. Each sender
    quantizes with its own key (``key`` folded with its axis index), so the errors of different
    senders are independent; with stochastic rounding the result is unbiased. ``kernels``:
    ``QSDPConfig.kernels`` (:func:`qsdp_jax.kernels.select`). ``rotation``:
    ``QSDPConfig.grad_rotation``, a Hadamard block size (:mod:`qsdp_jax._src.rotation`): chunk ``i``
    is rotated with signs keyed by (``key``, ``i``) before quantizing, and the receiver undoes
    it after the sum. ``stats_dtype``: ``QSDPConfig.stats_dtype``.
    """
    num = lax.axis_size(axis_name)
    n = full.shape[-1]
    if n % (num * bucket):
        raise ValueError(f"buffer of {n} elements does not split into {num} chunks of whole buckets of {bucket}")
    chunk = n // num
    sender_key = qz.derive_key(key, lax.axis_index(axis_name))
    sd = stats_dtype
    rows = full.reshape(num, chunk)
    if rotation is not None:
        rows = qr.rotate(rows, qr.chunk_signs(key, jnp.arange(num), chunk), rotation)
    payload = qk.select(
        stats_kernels(kernels, sd),
        lambda x: to_payload(qz.quantize(x, bits, bucket, rounding, sender_key, stats_dtype=sd),
                             split=True, stats_dtype=sd),
        lambda x, target: payload_from_packed(
            *qk.quantize_pack(x, bits, bucket, rounding, sender_key, target=target)),
        rows, bucket=bucket,
    )
    received = lax.all_to_all(payload, axis_name, 0, 0, tiled=False)  # (N, payload)
    summed = qk.select(
        kernels,
        lambda p: dequantize_rows(p, chunk, bits, bucket, summed=True, stats_dtype=sd),  # (N, payload) -> (chunk,)
        lambda p, target: qk.unpack_dequantize_sum(
            *split_payload(p, chunk, bits, bucket, sd), bits, bucket, chunk, target=target),
        received, bucket=bucket,
    )
    if rotation is None:
        return summed
    mine = qr.chunk_signs(key, lax.axis_index(axis_name)[None], chunk)[0]
    return qr.unrotate(summed, mine, rotation)


def reduce_scatter_fp(full: jax.Array, *, axis_name: str, dtype: str = "float32") -> jax.Array:
    """Plain reduce-scatter (sum) in float32 or bfloat16; float32 result.

    float32 is XLA's reduce-scatter. bfloat16 is an ``all_to_all`` of the bf16 chunks (bitcast
    to uint16, see :func:`all_gather_fp`) summed in float32: the same bytes as a bf16
    reduce-scatter, with a float32 sum.
    """
    if dtype == "float32":
        return lax.psum_scatter(full.astype(jnp.float32), axis_name, scatter_dimension=0, tiled=True)
    num = lax.axis_size(axis_name)
    wire = lax.bitcast_convert_type(full.astype(jnp.bfloat16), jnp.uint16).reshape(num, -1)
    got = lax.all_to_all(wire, axis_name, 0, 0, tiled=False)
    return sum_rows(lax.bitcast_convert_type(got, jnp.bfloat16).astype(jnp.float32))


# ----------------------------------------------------------------------------------------------
# The gather / reduce-scatter pair as one differentiable op
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GatherSpec:
    """Static description of how one buffer is gathered and its gradient reduce-scattered.

    weight_mode ``"qsdp"`` needs a grid at call time; ``"comm"`` rounds to nearest on the fly;
    ``"full"`` sends ``fp_dtype``. ``grad_bits=None`` reduce-scatters in ``fp_dtype``.
    """

    axis_name: str
    bucket: int
    weight_mode: str
    weight_bits: int | None
    grad_bits: int | None
    grad_rounding: qz.QRounding = "stochastic"
    fp_dtype: str = "float32"
    kernels: str = "auto"
    grad_rotation: int | None = None
    stats_dtype: str = "float32"

    @classmethod
    def from_config(cls, config) -> "GatherSpec":
        return cls(
            grad_rotation=config.grad_rotation,
            stats_dtype=config.stats_dtype,
            axis_name=config.axis_name,
            bucket=config.bucket_size,
            weight_mode=config.weight_mode,
            weight_bits=config.weight_bits,
            grad_bits=config.grad_bits,
            grad_rounding=config.grad_rounding,
            fp_dtype=config.fp_comm_dtype,
            kernels=config.kernels,
        )

    def gather(self, shard, grid):
        if self.weight_mode == "full":
            return all_gather_fp(shard, axis_name=self.axis_name, dtype=self.fp_dtype)
        if self.weight_mode == "qsdp" and grid is None:
            raise ValueError("weight_mode='qsdp' gathers need the grid the shard lies on")
        assert self.weight_bits is not None  # QSDPConfig: 'qsdp' / 'comm' weights have bits
        return quantized_all_gather(
            shard,
            bits=self.weight_bits,
            bucket=self.bucket,
            axis_name=self.axis_name,
            grid=grid if self.weight_mode == "qsdp" else None,
            rounding="nearest",
            kernels=self.kernels,
            stats_dtype=self.stats_dtype,
        )

    def reduce_scatter(self, full, key):
        if self.grad_bits is None:
            return reduce_scatter_fp(full, axis_name=self.axis_name, dtype=self.fp_dtype)
        return quantized_reduce_scatter(
            full,
            bits=self.grad_bits,
            bucket=self.bucket,
            axis_name=self.axis_name,
            key=key,
            rounding=self.grad_rounding,
            kernels=self.kernels,
            rotation=self.grad_rotation,
            stats_dtype=self.stats_dtype,
        )


@functools.lru_cache(maxsize=None)
def make_gather(spec: GatherSpec):
    """``gather(shard, grid, key) -> full``: forward ``spec.gather``; backward reduce-scatters
    the cotangent with ``spec.reduce_scatter`` under ``key`` (summed over devices, not averaged).
    ``grid`` and ``key`` get no gradient."""

    @jax.custom_vjp
    def gather(shard, grid, key):
        return spec.gather(shard, grid)

    def fwd(shard, grid, key):
        return spec.gather(shard, grid), key

    def bwd(key, ct):
        return spec.reduce_scatter(ct.astype(jnp.float32), key), None, None

    gather.defvjp(fwd, bwd)
    return gather
