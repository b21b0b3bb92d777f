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
  :func:`make_gather_pieces` (the train step's) returns the gathered buffer as per-leaf
  pieces, which the quantized gathers decode straight into; :func:`make_coded_gather` is its
  twin for code-held weights, which gathers a payload built from the stored codes.

Shards are 1-D with a length that is a multiple of the bucket size; full buffers are the N
shards concatenated in device order. The payload format (packed codes, then the stats) and its
receive side live in :mod:`qsdp_jax._src.quant.payload`; a shard quantized into it and the gathered
payloads read back, through the selected kernels, in :mod:`qsdp_jax._src.quant.payload_codec`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from qsdp_jax import kernels as qk
from qsdp_jax._src.quant import quantizers as qz
from qsdp_jax._src.quant import rotation as qr
from qsdp_jax._src.quant.payload_codec import (  # noqa: F401  (re-exported for callers of collectives)
    dequantize_payloads,
    dequantize_spans,
    quantize_payload,
    stats_kernels,
)
from qsdp_jax._src.collective.gather_pair import make_coded_gather, make_gather, make_gather_pieces  # noqa: F401  (re-exported)
from qsdp_jax._src.layout.packing import gather_each_piece
from qsdp_jax._src.collective.tpu_wire import all_gather_rows, all_to_all_words
from qsdp_jax.kernels._tpu import sum_fits
from qsdp_jax._src.quant.payload import (  # noqa: F401  (the wire format; re-exported for callers of collectives)
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

    Call it inside ``jax.shard_map`` over a mesh with ``axis_name``. One ``all_gather`` of one
    uint8 buffer per device: the packed codes, then the per-bucket scales and offsets.

    Args:
      shard: this device's 1-D shard, its length a multiple of ``bucket`` (any float dtype;
        quantized as float32).
      bits: bits per code, 1..8.
      bucket: elements per (scale, offset) pair, a multiple of 8.
      axis_name: the mesh axis to gather over.
      grid: ``(scales, offsets)`` of a grid the shard already lies on (QSDP mode), one of each
        per bucket; the codes are recovered exactly and the result equals the plain gather bit
        for bit. None (the default): quantize on each bucket's min/max grid with ``rounding``.
      rounding: how to quantize when no grid is given: ``"nearest"`` (the default,
        ZeRO++-style), ``"stochastic"`` or ``"shift"`` (both need ``key``).
      key: the uint32 key of the rounding's randomness (``qsdp_jax._src.quant.randomness.derive_key``);
        unused with a grid or ``"nearest"``.
      kernels: ``QSDPConfig.kernels``: who quantizes + packs and unpacks + dequantizes
        (:func:`qsdp_jax.kernels.select`); default ``"auto"``.
      stats_dtype: ``QSDPConfig.stats_dtype``: per-bucket stats on the wire as ``"float32"``
        (the default) or ``"bfloat16"`` (a ``grid`` must then hold bf16 values).

    Returns:
      The float32 full buffer of ``axis_size * len(shard)`` elements, the shards in device order.

    Raises:
      ValueError: ``bits`` not in 1..8, a shard length that is not whole buckets, an unknown
        ``kernels`` or ``stats_dtype``; without a grid, an unknown ``rounding``, a rounding that
        needs a key without one, or ``"shift"`` with bf16 stats.
    """
    n = shard.shape[-1]
    payload = quantize_payload(
        shard, bits=bits, bucket=bucket, grid=grid, rounding=rounding, key=key, kernels=kernels, stats_dtype=stats_dtype
    )
    return all_gather_payload(
        payload, n, bits=bits, bucket=bucket, axis_name=axis_name, kernels=kernels, stats_dtype=stats_dtype
    )


def all_gather_payload(payload, n, *, bits, bucket, axis_name, kernels="auto", stats_dtype="float32") -> jax.Array:
    """The second half of :func:`quantized_all_gather`: ``all_gather`` a built uint8 payload of
    ``n`` elements (e.g. code-held weights' stored codes and grid) and dequantize every sender's
    part; the float32 full buffer."""
    gathered = all_gather_rows(payload, axis_name)  # (N, payload)
    return dequantize_payloads(gathered, n, bits=bits, bucket=bucket, kernels=kernels, stats_dtype=stats_dtype)


def all_gather_fp(shard: jax.Array, *, axis_name: str, dtype: str = "float32") -> jax.Array:
    """Plain all-gather in float32 or bfloat16 (weights cast for the wire); float32 result.

    bfloat16 travels bitcast to uint16: XLA's CPU backend otherwise widens bf16 collectives to
    f32, and the bytes on the wire would not be the ones the baseline claims. On TPU the parts
    go as :func:`qsdp_jax._src.collective.tpu_wire.all_gather_rows` sends them (bf16 as 32-bit words).

    Args:
      shard: this device's shard (gathered along its first axis).
      axis_name: the mesh axis to gather over.
      dtype: the wire dtype, ``"float32"`` (the default) or ``"bfloat16"``
        (``QSDPConfig.fp_comm_dtype``; any other value is taken as bfloat16).

    Returns:
      The float32 concatenation of every device's shard along the first axis, in device order.
    """
    if dtype == "float32":
        return all_gather_rows(shard.astype(jnp.float32), axis_name, tiled=True)
    wire = lax.bitcast_convert_type(shard.astype(jnp.bfloat16), jnp.uint16)
    got = all_gather_rows(wire, axis_name, tiled=True)
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

    Call it inside ``jax.shard_map``. Each device quantizes its ``full`` buffer as N chunks
    (chunk ``i`` for device ``i``), one ``all_to_all`` moves the packed bytes, and each device
    dequantizes and sums the N chunks it received in float32. Each sender quantizes with its own
    key (``key`` folded with its axis index), so the errors of different senders are
    independent; with stochastic rounding the result is unbiased.

    Args:
      full: this device's full 1-D buffer of ``N * chunk`` elements (N the size of
        ``axis_name``), ``chunk`` a multiple of ``bucket``.
      bits: bits per code, 1..8.
      bucket: elements per (scale, offset) pair, a multiple of 8.
      axis_name: the mesh axis to reduce over.
      key: the uint32 key of the rounding's randomness, the same on every device
        (``qsdp_jax._src.quant.randomness.derive_key``).
      rounding: ``"stochastic"`` (the default, unbiased), ``"nearest"`` or ``"shift"``.
      kernels: ``QSDPConfig.kernels`` (:func:`qsdp_jax.kernels.select`); default ``"auto"``.
      rotation: ``QSDPConfig.grad_rotation``, None (the default) or a Hadamard block size (a
        power of 2 >= 2 dividing ``chunk``; :mod:`qsdp_jax._src.quant.rotation`): chunk ``i`` is
        rotated with signs keyed by (``key``, ``i``) before quantizing, and the receiver undoes
        it after the sum.
      stats_dtype: ``QSDPConfig.stats_dtype``: ``"float32"`` (the default) or ``"bfloat16"``.

    Returns:
      This device's chunk of the sum over devices, float32, ``chunk`` elements.

    Raises:
      ValueError: ``full`` does not split into N chunks of whole buckets; ``bits`` not in 1..8;
        an unknown ``rounding``, ``kernels`` or ``stats_dtype``; an invalid ``rotation``.
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
        lambda x: to_payload(
            qz.quantize(x, bits, bucket, rounding, sender_key, stats_dtype=sd), split=True, stats_dtype=sd
        ),
        lambda x, target: payload_from_packed(*qk.quantize_pack(x, bits, bucket, rounding, sender_key, target=target)),
        rows,
        bucket=bucket,
    )
    received = all_to_all_words(payload, axis_name)  # (N, payload)
    summed = qk.select(
        kernels,
        lambda p: dequantize_rows(p, chunk, bits, bucket, summed=True, stats_dtype=sd),  # (N, payload) -> (chunk,)
        lambda p, target: qk.unpack_dequantize_sum(
            *split_payload(p, chunk, bits, bucket, sd), bits, bucket, chunk, target=target
        ),
        received,
        bucket=bucket,
        tpu_fits=sum_fits(num, bucket),  # past 128 senders the TPU kernel's block does not fit
    )
    if rotation is None:
        return summed
    mine = qr.chunk_signs(key, lax.axis_index(axis_name)[None], chunk)[0]
    return qr.unrotate(summed, mine, rotation)


def reduce_scatter_fp(
    full: jax.Array, *, axis_name: str, dtype: str = "float32", by_all_to_all: bool = False
) -> jax.Array:
    """Plain reduce-scatter (sum) in float32 or bfloat16; float32 result.

    float32 is XLA's reduce-scatter, or with ``by_all_to_all`` an ``all_to_all`` of the devices'
    chunks summed on the receiver (pairwise): XLA:TPU compiles a ``psum_scatter`` as an all-reduce
    of the whole buffer and a slice, which its async collective options did not run under the
    backward loop's matmuls beside the prefetched gather, where they do run an all-to-all
    (GPT-125M fp32 on v5p-8); across TPU slices XLA splits the all-reduce by level and the
    all-to-all it does not, so only a single slice's prefetching step asks for it
    (``overlap.Prefetch``). bfloat16 is an ``all_to_all`` of the bf16 chunks (bitcast
    to uint16, see :func:`all_gather_fp`; on TPU as uint32 words, :func:`all_to_all_words`)
    summed in float32: the same bytes as a bf16 reduce-scatter, with a float32 sum.

    Args:
      full: this device's full 1-D buffer, its length a multiple of the size of ``axis_name``.
      axis_name: the mesh axis to reduce over.
      dtype: the wire dtype, ``"float32"`` (the default) or ``"bfloat16"``
        (``QSDPConfig.fp_comm_dtype``; any other value is taken as bfloat16).
      by_all_to_all: float32 as an ``all_to_all`` and a sum (above).

    Returns:
      This device's chunk (``len(full) / N`` elements) of the sum over devices, float32.
    """
    if dtype == "float32" and by_all_to_all:
        num = lax.axis_size(axis_name)
        return sum_rows(lax.all_to_all(full.astype(jnp.float32).reshape(num, -1), axis_name, 0, 0, tiled=False))
    if dtype == "float32":
        return lax.psum_scatter(full.astype(jnp.float32), axis_name, scatter_dimension=0, tiled=True)
    num = lax.axis_size(axis_name)
    wire = lax.bitcast_convert_type(full.astype(jnp.bfloat16), jnp.uint16).reshape(num, -1)
    got = all_to_all_words(wire, axis_name)
    return sum_rows(lax.bitcast_convert_type(got, jnp.bfloat16).astype(jnp.float32))


# ----------------------------------------------------------------------------------------------
# The gather / reduce-scatter pair as one differentiable op
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GatherSpec:
    """Static description of how one buffer is gathered and its gradient reduce-scattered.

    weight_mode ``"qsdp"`` needs a grid at call time; ``"comm"`` rounds to nearest on the fly;
    ``"full"`` sends ``fp_dtype``. ``grad_bits=None`` reduce-scatters in ``fp_dtype``. Frozen
    and hashable: :func:`make_gather` caches one differentiable gather per spec.

    Attributes:
      axis_name: the mesh axis of both collectives.
      bucket: elements per (scale, offset) pair (``QSDPConfig.bucket_size``).
      weight_mode: ``"qsdp"``, ``"comm"`` or ``"full"`` (``QSDPConfig.weight_mode``).
      weight_bits: bits of the weight gather; None in ``"full"`` mode.
      grad_bits: bits of the gradient reduce-scatter, or None for ``fp_dtype``.
      grad_rounding: the gradients' rounding, ``"stochastic"`` (the default) or ``"nearest"``.
      fp_dtype: dtype of the collectives that are not quantized, ``"float32"`` (the default) or
        ``"bfloat16"`` (``QSDPConfig.fp_comm_dtype``).
      kernels: ``QSDPConfig.kernels`` (default ``"auto"``).
      grad_rotation: ``QSDPConfig.grad_rotation`` (default None).
      stats_dtype: ``QSDPConfig.stats_dtype`` (default ``"float32"``).
      fp_by_all_to_all: a float32 reduce-scatter goes as an ``all_to_all`` and a sum
        (:func:`reduce_scatter_fp`; set by a prefetching TPU step, ``overlap.Prefetch``).
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
    fp_by_all_to_all: bool = False

    @classmethod
    def from_config(cls, config) -> "GatherSpec":
        """The spec of a config's collectives on its ``axis_name`` (one level: the two-level
        meshes' collectives are built elsewhere, ``qsdp_jax._src.collective.hierarchy``).

        Args:
          config: a :class:`~qsdp_jax.QSDPConfig`.

        Returns:
          The spec with the config's axis name, bucket size, weight mode and bits, gradient
          bits and rounding, ``fp_comm_dtype``, kernels, gradient rotation and stats dtype.
        """
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
        """The forward collective: all-gather ``shard`` as this spec says.

        Args:
          shard: this device's 1-D shard.
          grid: ``(scales, offsets)`` of the grid the shard lies on, in ``"qsdp"`` mode (ignored
            otherwise).

        Returns:
          The float32 full buffer (:func:`quantized_all_gather` or :func:`all_gather_fp`).

        Raises:
          ValueError: ``"qsdp"`` mode without a grid, or as :func:`quantized_all_gather`.
        """
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

    def gather_pieces(self, shard, grid, spans):
        """:meth:`gather` cut into pieces: for each ``(offset, size)`` of ``spans`` (offsets
        whole buckets), the float32 ``(senders, size)`` piece of every device's shard. A
        quantized gather decodes its payloads straight into the pieces (no full buffer).

        Raises:
          ValueError: as :meth:`gather`.
        """
        if self.weight_mode == "full":
            return gather_each_piece(self, shard, spans)
        if self.weight_mode == "qsdp" and grid is None:
            raise ValueError("weight_mode='qsdp' gathers need the grid the shard lies on")
        assert self.weight_bits is not None  # QSDPConfig: 'qsdp' / 'comm' weights have bits
        payload = quantize_payload(
            shard,
            bits=self.weight_bits,
            bucket=self.bucket,
            grid=grid if self.weight_mode == "qsdp" else None,
            rounding="nearest",
            kernels=self.kernels,
            stats_dtype=self.stats_dtype,
        )
        return self.payload_pieces(payload, shard.shape[-1], spans)

    def payload_pieces(self, payload, n, spans):
        """:meth:`gather_pieces` of a built payload of ``n`` elements (code-held weights send
        their stored codes and grid as they are)."""
        assert self.weight_bits is not None  # a payload holds codes
        rows = all_gather_rows(payload, self.axis_name)  # (N, payload)
        kw = dict(bits=self.weight_bits, bucket=self.bucket, kernels=self.kernels, stats_dtype=self.stats_dtype)
        return dequantize_spans(rows, n, spans, **kw)

    def reduce_scatter(self, full, key):
        """The backward collective: reduce-scatter (sum) ``full`` as this spec says.

        Args:
          full: this device's full 1-D buffer (a gradient).
          key: the uint32 key of the quantization's randomness (unused with ``grad_bits=None``).

        Returns:
          This device's float32 chunk of the sum (:func:`quantized_reduce_scatter` or
          :func:`reduce_scatter_fp`).

        Raises:
          ValueError: as :func:`quantized_reduce_scatter`.
        """
        if self.grad_bits is None:
            return reduce_scatter_fp(
                full, axis_name=self.axis_name, dtype=self.fp_dtype, by_all_to_all=self.fp_by_all_to_all
            )
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
