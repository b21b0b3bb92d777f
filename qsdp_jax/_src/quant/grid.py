"""QSDP's weight grid in the optimizer's global view: fresh grids, and snapping onto them.

The optimizer sees global arrays (``qsdp_jax.optim``). A gridded leaf's buckets live inside one
device's shard (``qsdp_jax.layout``), so both operations here run *per device* on its block,
inside a ``shard_map`` over the leaf's own sharding, with global bucket ids: the grid of a
bucket depends on its id, never on which device computes it.

* :func:`project`: each leaf's values onto a fresh grid of its bits (per-bucket min/max; shift or
  stochastic rounding per ``QSDPConfig.weight_rounding``, keyed by ``(seed, count, leaf)``);
* :func:`snap`: values moved exactly onto a stored grid (what makes the gather lossless).

Where the leaves live is declared by the train step while it traces (:func:`layout_context`:
the :class:`~qsdp_jax.layout.ParamLayout`, the mesh and the shard axes). Outside one (a plain
single-device loop) every floating leaf with at least ``min_shard_size`` elements is one row,
padded to whole buckets, and the rest stay full precision.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from qsdp_jax import kernels as qk
from qsdp_jax._src.layout import policy
from qsdp_jax._src.layout.alike import opaque_ints
from qsdp_jax._src.quant import quantizers as qz
from qsdp_jax._src.quant.payload import cpu_boundary
from qsdp_jax.layout import ParamLayout, leaf_spec

PURPOSE_WEIGHT = 1


class LayoutContext(NamedTuple):
    layout: ParamLayout
    mesh: Mesh
    axes: Any  # QSDPConfig.shard_axes


_CONTEXT: contextvars.ContextVar[LayoutContext | None] = contextvars.ContextVar("qsdp_layout", default=None)


@contextlib.contextmanager
def layout_context(layout: ParamLayout, mesh: Mesh, axes):
    """Declare, while tracing, that the params the optimizer sees are sharded by ``layout``."""
    token = _CONTEXT.set(LayoutContext(layout, mesh, axes))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> LayoutContext | None:
    return _CONTEXT.get()


@dataclasses.dataclass(frozen=True)
class LeafGrid:
    """The grid geometry of one params leaf: ``rows`` x (``buckets`` per device) buckets.

    ``bits`` None: the leaf has no grid (full precision). ``spec`` None: the leaf is one block
    (single-device, or replicated); else its PartitionSpec, and ``num_shards`` blocks.
    """

    bits: int | None
    rows: int
    size: int  # real elements per row of one block
    buckets: int  # buckets per row of one block
    spec: P | None = None
    num_shards: int = 1


def geometries(params: Any, config) -> list[LeafGrid]:
    """The :class:`LeafGrid` of every leaf of ``params`` (``jax.tree.leaves`` order)."""
    ctx = current_context()
    b = config.bucket_size
    params_leaves = jax.tree_util.tree_leaves(params)
    if ctx is None:
        bits = (
            policy.tree_weight_bits(params, config) if config.bit_policy else [config.weight_bits] * len(params_leaves)
        )
        out = []
        for x, w in zip(params_leaves, bits):
            gridded = jnp.issubdtype(x.dtype, jnp.floating) and x.size >= max(config.min_shard_size, 1)
            out.append(LeafGrid(w if gridded else None, 1, x.size, -(-x.size // b)))
        return out
    layout = ctx.layout
    if len(params_leaves) != sum(g.num_leaves for g in layout.groups):
        raise ValueError("the params the optimizer sees do not match the train state's layout")
    out = []
    for (g, x), w in zip(layout.leaves(), layout.weight_bits(config)):
        if w is None:
            out.append(LeafGrid(None, 1, 0, 0))
            continue
        out.append(
            LeafGrid(
                w,
                max(g.n_layers, 1) if g.stacked else 1,
                x.local_size,
                x.buckets,
                leaf_spec(g, x, ctx.axes),
                layout.num_shards,
            )
        )
    return out


def empty_grid() -> jax.Array:
    return jnp.zeros((0,), jnp.float32)


def grid_shape(geo: LeafGrid) -> tuple[int, ...]:
    """The global shape of a leaf's scales (and offsets)."""
    return (0,) if geo.bits is None else (geo.rows, geo.buckets * geo.num_shards)


# ----------------------------------------------------------------------------------------------
# One device's block
# ----------------------------------------------------------------------------------------------
def rows_of(x, geo: LeafGrid, bucket: int):
    r = x.reshape(geo.rows, geo.size).astype(jnp.float32)
    pad = geo.buckets * bucket - geo.size
    return jnp.pad(r, ((0, 0), (0, pad)), mode="edge") if pad else r


def _bucket_ids(geo: LeafGrid, shard) -> jax.Array:
    local = jnp.arange(geo.buckets, dtype=jnp.uint32)
    stride = jnp.uint32(geo.buckets * geo.num_shards)
    rows = jnp.arange(geo.rows, dtype=jnp.uint32)[:, None]
    return rows * stride + jnp.asarray(shard, jnp.uint32) * jnp.uint32(geo.buckets) + local[None, :]


def _project_block(x, geo: LeafGrid, config, key, shard, rounding=None):
    bucket, bits = config.bucket_size, geo.bits
    assert bits is not None  # project() and snap() pass the gridded leaves only
    rounding = config.weight_rounding if rounding is None else rounding

    def reference(r, k, i):
        qt = qz.quantize(r, bits, bucket, rounding, k, bucket_ids=i)
        return qt.dequantize(), qt.scales, qt.offsets

    def kernel(r, k, i, target):
        return qk.project(r, bits, bucket, rounding, k, bucket_ids=i, target=target)

    # float32 grids only: QSDPConfig refuses bf16 stats with on-grid weights. Behind
    # cpu_boundary, the projection is computed once: fused into its consumers (the update, the
    # finiteness check, the snap, the kept state), XLA:CPU compiled the whole chain (noise hash,
    # bucket stats, rounding) into each of them, 2.7x the step's fused code of fp32's.
    ids = _bucket_ids(geo, shard)
    values, scales, offsets = cpu_boundary(
        lambda r: qk.select(config.kernels, reference, kernel, r, key, ids, bucket=bucket), rows_of(x, geo, bucket)
    )
    return values[:, : geo.size].reshape(x.shape).astype(x.dtype), scales, offsets


def _snap_block(x, scales, offsets, geo: LeafGrid, config):
    bucket, bits = config.bucket_size, geo.bits
    assert bits is not None  # project() and snap() pass the gridded leaves only
    values = qk.select(
        config.kernels,
        lambda r, s, o: qz.quantize_on_grid(r, s, o, bits, bucket).dequantize(),
        lambda r, s, o, target: qk.snap(r, s, o, bits, bucket, target=target),
        rows_of(x, geo, bucket),
        scales,
        offsets,
        bucket=bucket,
    )
    return values[:, : geo.size].reshape(x.shape).astype(x.dtype)


def per_device(fn, geos: list[LeafGrid], kinds_in: str, kinds_out: str, *args):
    """``fn(shard index, *blocks)`` on each device's blocks of the sharded leaves (a shard_map
    over their specs), or on the whole leaves outside a layout context.

    ``args`` and ``fn``'s results are lists over ``geos``; ``kinds_in`` / ``kinds_out`` say per
    argument / result whether it is laid out like the leaves (``"l"``) or like their grids
    (``"g"``: ``(rows, buckets)`` split on the last axis, as are code-held weights)."""
    ctx = current_context()
    if ctx is None or not geos:
        return fn(jnp.uint32(0), *args)
    by_kind = {"l": [g.spec for g in geos], "g": [P(None, ctx.axes)] * len(geos)}
    in_specs = tuple(by_kind[k] for k in kinds_in)
    out_specs = tuple(by_kind[k] for k in kinds_out)

    def local(*blocks):
        return fn(lax.axis_index(ctx.axes), *blocks)

    return jax.shard_map(local, mesh=ctx.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


# ----------------------------------------------------------------------------------------------
# The global view
# ----------------------------------------------------------------------------------------------
def project(leaves: Sequence[jax.Array], geos: Sequence[LeafGrid], config, count, rounding=None):
    """Each gridded leaf onto a fresh grid keyed by ``(seed, count, leaf index)``, rounded per
    ``config.weight_rounding`` (or ``rounding``, e.g. ``"nearest"``).

    Returns:
      ``(values, scales, offsets)``, lists over the leaves: None / the empty grid where a leaf
      has no grid.
    """
    idx = [i for i, g in enumerate(geos) if g.bits is not None]
    if not idx:
        return [None] * len(leaves), [empty_grid()] * len(leaves), [empty_grid()] * len(leaves)
    sub = [geos[i] for i in idx]

    def fn(shard, blocks):
        # the leaf index as a value XLA cannot see: one key kernel for every leaf (on XLA:CPU)
        keys = [qz.derive_key(config.seed, PURPOSE_WEIGHT, count, i) for i in opaque_ints(idx, jnp.asarray(count))]
        out = [_project_block(x, g, config, k, shard, rounding) for x, g, k in zip(blocks, sub, keys)]
        return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]

    values, scales, offsets = per_device(fn, sub, "l", "lgg", [leaves[i] for i in idx])
    out_v, out_s, out_o = [None] * len(leaves), [empty_grid()] * len(leaves), [empty_grid()] * len(leaves)
    for j, i in enumerate(idx):
        out_v[i], out_s[i], out_o[i] = values[j], scales[j], offsets[j]
    return out_v, out_s, out_o


def snap(leaves: Sequence[jax.Array], geos: Sequence[LeafGrid], scales, offsets, config) -> list:
    """The leaves moved exactly onto their stored grids (leaves without one unchanged)."""
    idx = [i for i, g in enumerate(geos) if g.bits is not None]
    if not idx:
        return list(leaves)
    sub = [geos[i] for i in idx]

    def fn(shard, blocks, s, o):
        del shard
        return ([_snap_block(x, a, b, g, config) for x, a, b, g in zip(blocks, s, o, sub)],)

    out = list(leaves)
    picked = [[x[i] for i in idx] for x in (leaves, scales, offsets)]
    (snapped,) = per_device(fn, sub, "lgg", "l", *picked)
    for j, i in enumerate(idx):
        out[i] = snapped[j]
    return out
