"""Rows of a sharded table read from the devices' blocks: ``ShardedParams.take``.

``take(path, ids)`` gives ``jnp.take(table, ids, axis=0)`` (an embedding lookup) without the
table: neither pass holds a full table or a full table-sized gradient.

* **Split on the rows** (the layout's dimension 0, the vocabulary): every device's ids are
  all-gathered (4 bytes each), each device reads the rows in its block (zeros for the others)
  and one reduce-scatter over the devices hands each device its own rows. A row has one owner
  and the others add zeros, so the rows are exact.
* **Split on a feature dimension**: each device reads its columns of every device's rows and
  one ``all_to_all`` returns to each device its own rows' columns.

The backward pass runs the transposes: the rows' cotangents are all-gathered (rows split) or
sent back by ``all_to_all`` (feature split) and scatter-added in float32 into the gradient of
this device's block, summed over a hybrid mesh's replicas; the step then averages it like every
other block's. That gradient is exact: the table's (quantized) reduce-scatter does not carry it.

Wire bytes per device and call: the ids all-gathered, plus ``N * len(ids) * width`` float32
values reduce-scattered forward and all-gathered backward (about ``(N-1)/N`` of that leaves each
device), against ``vocab * width`` weights all-gathered and reduce-scattered at their bits when
the table is gathered. At GPT-1.3B shapes on 8 devices (1024 ids per device, a 50304 x 2048
table) that is 59 MB each way, against 90 MB for an 8-bit gather of the table.

When the devices' ids are at least as many as the table's rows (``N * len(ids) >= vocab``: a
position table, every device reading the same rows) the table alone is all-gathered in its
dtype instead and read with ``jnp.take``; its gradient is reduce-scattered, exact as well.

Out-of-range ids give NaN rows and no gradient and negative ids count from the end, as with
``jnp.take``'s default mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qsdp_jax._src.collective.tpu_wire import all_to_all_words


@dataclasses.dataclass(frozen=True)
class Split:
    """How a table is split: static, hashable.

    Attributes:
      shape: this device's block's shape.
      dtype: the block's dtype (its gradient's).
      dim: the dimension the table is split on (0: the rows).
      vocab: the table's row count.
      axes: the shard axis, or axes (the block index is their combined index).
      replica_axis: a hybrid mesh's replica axis, or None.
    """

    shape: tuple[int, ...]
    dtype: str
    dim: int
    vocab: int
    axes: str | tuple[str, ...]
    replica_axis: str | None


def take_rows(block: jax.Array, values: jax.Array, ids: jax.Array, split: Split) -> jax.Array:
    """``table[ids]`` of a table split as ``split`` says, from this device's block.

    Call inside ``shard_map``. When the devices' ids outnumber the table's rows (a position
    table, whose ids every device repeats) the rows would cost more than the table: the leaf
    alone is all-gathered in its dtype instead (its gradient reduce-scattered, exact), and
    ``jnp.take`` reads it.

    Args:
      block: this device's block, the differentiated input (a zero anchor for code-held
        weights); its gradient is the rows' cotangents scatter-added (see the module docstring).
      values: the block's weights (``block`` itself, or the decoded codes); not differentiated.
      ids: this device's integer ids, any shape.
      split: how the table is split.

    Returns:
      The rows in ``values``' dtype, shape ``ids.shape + table.shape[1:]``.
    """
    n = lax.axis_size(split.axes)
    if n * ids.size >= split.vocab:
        full = _gather_leaf(block, lax.stop_gradient(values), split)
        return jnp.take(full, ids, axis=0)
    return _take(block, lax.stop_gradient(values), ids, split)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_leaf(block, values, split):
    return lax.all_gather(values, split.axes, axis=split.dim, tiled=True)


def _gather_leaf_fwd(block, values, split):
    return _gather_leaf(block, values, split), None


def _gather_leaf_bwd(split: Split, _, ct):
    grad = lax.psum_scatter(ct.astype(jnp.float32), split.axes, scatter_dimension=split.dim, tiled=True)
    if split.replica_axis is not None:
        grad = lax.psum(grad, split.replica_axis)
    return grad.astype(split.dtype), None


_gather_leaf.defvjp(_gather_leaf_fwd, _gather_leaf_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _take(block, values, ids, split):
    return _take_fwd(block, values, ids, split)[0]


def _take_fwd(block, values, ids, split: Split):
    ids_all = lax.all_gather(ids, split.axes)  # (N, *ids.shape)
    if split.dim == 0:
        per = split.shape[0]
        local = _normalized(ids_all, split.vocab) - lax.axis_index(split.axes) * per
        local = jnp.where((local >= 0) & (local < per), local, per)  # per: not in this block
        rows = jnp.take(values, local, axis=0, mode="fill", fill_value=0)
        rows = lax.psum_scatter(rows, split.axes, scatter_dimension=0, tiled=False)
        valid = _normalized(ids, split.vocab) < split.vocab
        rows = jnp.where(_expand(valid, rows), rows, jnp.full((), jnp.nan, rows.dtype))
        return rows, local
    rows = jnp.take(values, ids_all, axis=0)  # every device's rows, my columns
    got = all_to_all_words(rows, split.axes)  # got[i]: device i's columns of mine
    at = ids.ndim + split.dim - 1  # the split dimension in a row of ids.shape + row shape
    got = jnp.moveaxis(got, 0, at)
    shape = got.shape[:at] + (got.shape[at] * got.shape[at + 1],) + got.shape[at + 2 :]
    return got.reshape(shape), jnp.where(_normalized(ids_all, split.vocab) < split.vocab, ids_all, split.vocab)


def _take_bwd(split: Split, local, ct):
    ct = ct.astype(jnp.float32)
    ids_shape = local.shape[1:]
    if split.dim == 0:
        cts = lax.all_gather(ct, split.axes)  # (N, *ids.shape, ...)
    else:
        n = local.shape[0]
        at = len(ids_shape) + split.dim - 1
        ct = ct.reshape(ct.shape[:at] + (n, ct.shape[at] // n) + ct.shape[at + 1 :])
        cts = lax.all_to_all(jnp.moveaxis(ct, at, 0), split.axes, 0, 0, tiled=False)
    grad = jnp.zeros(split.shape, jnp.float32).at[local].add(cts, mode="drop")
    if split.replica_axis is not None:
        grad = lax.psum(grad, split.replica_axis)
    return grad.astype(split.dtype), None, np.zeros(ids_shape, jax.dtypes.float0)


_take.defvjp(_take_fwd, _take_bwd)


def _normalized(ids: jax.Array, vocab: int) -> jax.Array:
    """``ids`` with ``jnp.take``'s wrap of negative ids; out-of-range ones become ``vocab``."""
    ids = jnp.where(ids < 0, ids + vocab, ids)
    return jnp.where((ids >= 0) & (ids < vocab), ids, vocab)


def _expand(mask: jax.Array, x: jax.Array) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))
