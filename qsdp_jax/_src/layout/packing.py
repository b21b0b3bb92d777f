"""Copy-in / copy-out around one flat collective buffer per group (PyTorch FSDP2's idea).

The parameters are stored leaf by leaf (:mod:`qsdp_jax.layout`); the collectives move one flat
buffer per group (per layer), so that a layer costs one all-gather and one reduce-scatter
whatever its number of leaves, and quantization is batched. Inside ``shard_map``:

* :func:`pack` (copy-in): each leaf's local block, flattened row-major and zero-padded to
  whole buckets, concatenated in slot order: one device's ``(chunk,)`` buffer. Its buckets are
  exactly the leaves' own buckets (``ParamLayout``), so a leaf's grid is the buffer's grid.
* :func:`unpack` (copy-out): the gathered buffer's pieces (every device's block of each leaf,
  which the quantized gathers decode straight into, :func:`qsdp_jax.collectives.make_gather_pieces`)
  joined on each leaf's split dimension: the full leaves.

Both are plain array ops, so autodiff transposes them: the gradient of the full leaves is packed
into one buffer for the reduce-scatter, and the reduce-scattered chunk is cut into the local
blocks' gradients (the padding's share is dropped). :func:`split_flat` gives the cut a cheap
transpose.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from qsdp_jax._src.layout.policy import Buffer


def pack(buffer: Buffer, blocks: Sequence[jax.Array], bucket: int, lead: int = 0) -> jax.Array:
    """One device's flat float32 buffer of ``buffer``'s leaves.

    Args:
      buffer: the gather buffer (its slots name the leaves and their offsets).
      blocks: the group's local leaf blocks, indexed by leaf position (others may be anything).
      bucket: the bucket size: each block is padded to whole buckets.
      lead: leading axes (e.g. layers) every block carries before its own shape.

    Returns:
      ``(*lead_shape, buffer.chunk)`` float32.
    """
    parts = []
    for s in buffer.slots:
        x = jnp.asarray(blocks[s.index], jnp.float32)
        lead_shape = x.shape[:lead]
        parts.append(_pad_to(x.reshape(*lead_shape, s.size), -(-s.size // bucket) * bucket))
    return jnp.concatenate(parts, axis=-1)


def unpack(
    buffer: Buffer, pieces: Sequence[jax.Array], num_shards: int, dims: Sequence[int], shapes: Sequence[tuple[int, ...]]
) -> dict[int, jax.Array]:
    """The full leaves of ``buffer`` from its gathered pieces.

    Args:
      pieces: per slot, ``(*lead, num_shards, slot.size)``: every device's block, in device
        order (what ``split_flat`` cuts from the gathered buffer, or a gather decodes into).
      dims: per slot, the dimension of the leaf's (per-layer) shape it is split on.
      shapes: per slot, the leaf's full (per-layer) shape.

    Returns:
      ``{leaf index: (*lead, *shape) array in the leaf's dtype}``.
    """
    out = {}
    for s, piece, dim, shape in zip(buffer.slots, pieces, dims, shapes):
        lead = piece.shape[:-2]
        x = piece.reshape(*lead, num_shards, *s.shape)
        x = jnp.moveaxis(x, len(lead), len(lead) + dim).reshape(*lead, *shape)
        out[s.index] = x.astype(s.dtype)
    return out


def spans(buffer: Buffer) -> tuple[tuple[int, int], ...]:
    """``(offset, size)`` of each slot's block in one device's chunk of ``buffer``."""
    return tuple((s.offset, s.size) for s in buffer.slots)


def split_flat(flat: jax.Array, spans: tuple[tuple[int, int], ...]) -> tuple[jax.Array, ...]:
    """The pieces ``flat[..., offset : offset + size]`` for ``(offset, size)`` in ``spans``
    (increasing, non-overlapping).

    Differentiable like the slices, but its transpose is one concatenation of the cotangents
    with zeros in the gaps. The slices' own transpose pads every cotangent to the full buffer
    and adds them up: one buffer-sized temporary and add per leaf, which XLA:CPU kept
    unfused in the quantized step.
    """
    return _split(flat, tuple(spans), flat.shape[-1])


def gather_each_piece(spec, shard: jax.Array, spans: tuple[tuple[int, int], ...]) -> tuple[jax.Array, ...]:
    """The float32 ``(senders, size)`` pieces of an unquantized gather, one all-gather per piece:
    the bits of ``split_flat(spec.gather(shard, None).reshape(-1, n), spans)`` (a slice of every
    shard, gathered, is that slice of the gathered shards) and the same wire bytes.

    Not differentiable (the gather pairs' ``custom_vjp`` differentiates the whole). Slicing the
    gathered buffer made XLA:CPU copy each piece out of it while the buffer lived: at GPT-1.3B on 8
    devices the tied embedding's 412 MB copy set the fp32 step's peak (4364 -> 4162 MB).
    """
    return tuple(spec.gather(shard[..., o : o + n], None).reshape(-1, n) for o, n in spans)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _split(flat, spans, total):
    return tuple(flat[..., o : o + n] for o, n in spans)


def _split_fwd(flat, spans, total):
    return _split(flat, spans, total), None


def _split_bwd(spans, total, _, cts):
    return (join_pieces(cts, spans, total),)


def join_pieces(pieces: Sequence[jax.Array], spans: tuple[tuple[int, int], ...], total: int) -> jax.Array:
    """The inverse of :func:`split_flat`: the pieces at their ``(offset, size)`` spans of a
    ``(..., total)`` buffer, zeros in the gaps (one concatenation)."""
    lead, dtype = pieces[0].shape[:-1], pieces[0].dtype
    parts, end = [], 0
    for (o, n), piece in zip(spans, pieces):
        if o > end:
            parts.append(jnp.zeros((*lead, o - end), dtype))
        parts.append(jnp.asarray(piece, dtype))
        end = o + n
    if total > end:
        parts.append(jnp.zeros((*lead, total - end), dtype))
    return jnp.concatenate(parts, axis=-1)


_split.defvjp(_split_fwd, _split_bwd)


def _pad_to(x: jax.Array, n: int) -> jax.Array:
    pad = n - x.shape[-1]
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
