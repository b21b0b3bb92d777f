"""Optax transformations for QSDP: keep the weights on a randomly shifted quantization grid.

``qsdp(base, config)`` wraps any optax transformation. After the base update, each quantized
leaf's new value ``params + u`` is projected onto a fresh grid (per-bucket min/max scale, offset
shifted by ``xi * scale`` with ``xi ~ U[0, 1)``, round to nearest; unbiased in expectation over
``xi``) and the returned update is ``projected - params``. So ``optax.apply_updates(params,
updates)`` lands on the grid up to float rounding; :func:`snap_to_grid` lands on it exactly (the
sharded train step does this, which makes its weight all-gather lossless).

It works in two settings:

* **a plain single-device loop** (Flax or optax): every floating leaf with at least
  ``config.min_shard_size`` elements is flattened, padded to whole buckets and kept on its grid;
  smaller leaves are updated in full precision.
* **inside the sharded train step** (``qsdp_jax.make_train_step``), which declares through
  :func:`sharding_context` which leaves are local shards of flat buffers; bucket ids are then
  global, so the grid of a buffer does not depend on how many devices share it.

A step whose gradients hold NaN or Inf returns zero updates and the unchanged state (in the
sharded step the check is global over devices). Randomness: the shift of bucket ``b`` of leaf
``i`` after update ``count`` is ``hash(derive_key(seed, WEIGHT, count, i), b)``, a pure function
of the run's seed and position, never of host state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from qsdp_jax import kernels as qk
from qsdp_jax import policy
from qsdp_jax import quantizers as qz
from qsdp_jax.config import QSDPConfig
from qsdp_jax.shard_context import (  # noqa: F401  (re-exported: ``optim.sharding_context``, ...)
    ShardContext,
    all_finite,
    clip_by_global_norm,
    current_context,
    global_norm,
    sharding_context,
)

PyTree = Any
PURPOSE_WEIGHT = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QSDPState:
    """State of :func:`qsdp`.

    Attributes:
      count: number of applied (finite) updates; keys the grid shifts.
      scales, offsets: the current grid of every params leaf, per bucket (a zero-size array for
        leaves kept in full precision).
      inner: the base transformation's state.
      bits, bucket: static, checked against the train step's config.
      config: static, the whole config the optimizer was built with (the train step refuses
        another one).
    """

    count: jax.Array
    scales: PyTree
    offsets: PyTree
    inner: PyTree
    bits: int | None = dataclasses.field(metadata=dict(static=True))
    bucket: int = dataclasses.field(metadata=dict(static=True))
    config: QSDPConfig | None = dataclasses.field(default=None, metadata=dict(static=True))


# ----------------------------------------------------------------------------------------------
# Per-leaf grid geometry
# ----------------------------------------------------------------------------------------------
class _Geometry(NamedTuple):
    """How a params leaf maps to 2-D bucketed rows, and the global ids of its buckets."""

    sharded: bool
    rows: int
    cols: int  # padded to whole buckets
    size: int  # real elements per row (single-device: the leaf's size)


def _geometry(x: jax.Array, sharded: bool, bucket: int) -> _Geometry:
    if sharded:
        cols = x.shape[-1]
        if cols % bucket:
            raise ValueError(
                f"sharded leaf of local length {cols} is not whole buckets of {bucket}: the "
                f"optimizer was built with QSDPConfig.bucket_size={bucket}, the train state's "
                "layout with another; build both from the same QSDPConfig"
            )
        return _Geometry(True, x.size // cols, cols, cols)
    return _Geometry(False, 1, -(-x.size // bucket) * bucket, x.size)


def _as_rows(x: jax.Array, geo: _Geometry) -> jax.Array:
    if geo.sharded:
        return x.reshape(geo.rows, geo.cols).astype(jnp.float32)
    flat = x.reshape(1, geo.size).astype(jnp.float32)
    pad = geo.cols - geo.size
    return jnp.pad(flat, ((0, 0), (0, pad)), mode="edge") if pad else flat


def _from_rows(rows: jax.Array, like: jax.Array, geo: _Geometry) -> jax.Array:
    if geo.sharded:
        return rows.reshape(like.shape).astype(like.dtype)
    return rows[:, : geo.size].reshape(like.shape).astype(like.dtype)


def _bucket_ids(geo: _Geometry, bucket: int, ctx: ShardContext | None) -> jax.Array:
    nb = geo.cols // bucket
    local = jnp.arange(nb, dtype=jnp.uint32)
    if not geo.sharded:
        return local[None, :]
    shard = lax.axis_index(ctx.axis_name).astype(jnp.uint32)
    row_stride = jnp.uint32(nb * ctx.num_shards)
    rows = jnp.arange(geo.rows, dtype=jnp.uint32)[:, None]
    return rows * row_stride + shard * jnp.uint32(nb) + local[None, :]


def _mask_for(params: PyTree, config: QSDPConfig, ctx: ShardContext | None) -> list[bool]:
    leaves = jax.tree_util.tree_leaves(params)
    if ctx is not None:
        mask = jax.tree_util.tree_leaves(ctx.mask)
        if len(mask) != len(leaves):
            raise ValueError("sharding_context mask does not match the params structure")
        return [bool(m) for m in mask]
    return [
        jnp.issubdtype(x.dtype, jnp.floating) and x.size >= config.min_shard_size for x in leaves
    ]


def _bits_for(params: PyTree, config: QSDPConfig, ctx: ShardContext | None) -> list:
    """Weight bits of every params leaf (None: no grid): the sharding context's (a bit policy
    in the sharded step), else ``config.bit_policy`` on the leaf paths, else the config's."""
    if ctx is not None and ctx.bits is not None:
        return list(ctx.bits)
    if ctx is None and config.bit_policy:
        return policy.tree_weight_bits(params, config)
    return [config.weight_bits] * len(jax.tree_util.tree_leaves(params))


def _empty():
    return jnp.zeros((0,), jnp.float32)


def _project_leaf(x, geo, config, key, ctx, bits):
    """A fresh ``bits``-bit grid from the values of ``x`` (random shift, or stochastic rounding
    per ``config.weight_rounding``); returns (projected x, scales, offsets)."""
    rows = _as_rows(x, geo)
    ids = _bucket_ids(geo, config.bucket_size, ctx)
    bucket, rounding = config.bucket_size, config.weight_rounding

    def reference(r, k, i):
        qt = qz.quantize(r, bits, bucket, rounding, k, bucket_ids=i)
        return qt.dequantize(), qt.scales, qt.offsets

    def kernel(r, k, i, target):
        return qk.project(r, bits, bucket, rounding, k, bucket_ids=i, target=target)

    # float32 grids only: QSDPConfig refuses bf16 stats with on-grid weights
    values, scales, offsets = qk.select(config.kernels, reference, kernel, rows, key, ids, bucket=bucket)
    return _from_rows(values, x, geo), scales, offsets


def _project_leaves(values, mask, count, config, ctx, old_scales, old_offsets, bits):
    """Project each masked leaf onto a fresh grid of its ``bits`` keyed by (seed, count, leaf
    index).

    Returns (projected values, None where unmasked; scales; offsets, the old ones where
    unmasked)."""
    out_v, out_s, out_o = [], [], []
    for i, (x, m, b) in enumerate(zip(values, mask, bits)):
        if not m or b is None:
            out_v.append(None)
            out_s.append(old_scales[i])
            out_o.append(old_offsets[i])
            continue
        key = qz.derive_key(config.seed, PURPOSE_WEIGHT, count, i)
        v, sc, off = _project_leaf(x, _geometry(x, ctx is not None, config.bucket_size), config, key, ctx, b)
        out_v.append(v)
        out_s.append(sc)
        out_o.append(off)
    return out_v, out_s, out_o


def _snap_leaf(x, scales, offsets, geo, config, bits):
    rows = _as_rows(x, geo)
    bucket = config.bucket_size
    values = qk.select(
        config.kernels,
        lambda r, s, o: qz.quantize_on_grid(r, s, o, bits, bucket).dequantize(),
        lambda r, s, o, target: qk.snap(r, s, o, bits, bucket, target=target),
        rows, scales, offsets, bucket=bucket,
    )
    return _from_rows(values, x, geo)


# ----------------------------------------------------------------------------------------------
# The transformation
# ----------------------------------------------------------------------------------------------
def qsdp(base: optax.GradientTransformation, config: QSDPConfig) -> optax.GradientTransformationExtraArgs:
    """Wrap ``base`` so that parameters stay on QSDP's shifted grid (weight_mode ``"qsdp"``).

    With weight_mode ``"comm"`` or ``"full"`` the weights stay full precision and only the
    non-finite guard is added. ``update`` needs ``params`` in ``"qsdp"`` mode.
    """
    if not isinstance(config, QSDPConfig):
        raise TypeError(f"config must be a QSDPConfig, got {type(config).__name__}")
    base = optax.with_extra_args_support(base)
    projecting = config.weight_mode == "qsdp"

    def init(params):
        ctx = current_context()
        leaves, treedef = jax.tree_util.tree_flatten(params)
        mask = _mask_for(params, config, ctx) if projecting else [False] * len(leaves)
        count = jnp.zeros((), jnp.int32)
        inner = base.init(params)
        if find_qsdp_state(inner) is not None:
            raise ValueError(
                "the optimizer is wrapped with qsdp_jax.optim.qsdp() twice: wrap the base "
                "optimizer once (qsdp(base, config))"
            )
        empty = [_empty()] * len(leaves)
        bits = _bits_for(params, config, ctx)
        _, scales, offsets = _project_leaves(leaves, mask, count, config, ctx, empty, empty, bits)
        return QSDPState(
            count=count,
            scales=jax.tree_util.tree_unflatten(treedef, scales),
            offsets=jax.tree_util.tree_unflatten(treedef, offsets),
            inner=inner,
            bits=config.weight_bits if projecting else None,
            bucket=config.bucket_size,
            config=config,
        )

    def update(updates, state: QSDPState, params=None, **extra_args):
        ctx = current_context()
        if projecting and params is None:
            raise ValueError("qsdp_jax.optim.qsdp needs params in update() to project onto the grid")
        finite = all_finite(updates)
        inner_updates, inner_state = base.update(updates, state.inner, params, **extra_args)
        count = state.count + 1
        scales, offsets = state.scales, state.offsets
        if projecting:
            leaves, treedef = jax.tree_util.tree_flatten(params)
            moved = [p + u.astype(p.dtype) for p, u in zip(leaves, treedef.flatten_up_to(inner_updates))]
            proj, new_s, new_o = _project_leaves(
                moved, _mask_for(params, config, ctx), count, config, ctx,
                treedef.flatten_up_to(state.scales), treedef.flatten_up_to(state.offsets),
                _bits_for(params, config, ctx),
            )
            new_u = [u if v is None else v - p
                     for p, u, v in zip(leaves, treedef.flatten_up_to(inner_updates), proj)]
            inner_updates = jax.tree_util.tree_unflatten(treedef, new_u)
            scales = jax.tree_util.tree_unflatten(treedef, new_s)
            offsets = jax.tree_util.tree_unflatten(treedef, new_o)
        new_state = QSDPState(
            count=count, scales=scales, offsets=offsets, inner=inner_state,
            bits=state.bits, bucket=state.bucket, config=state.config,
        )
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        out_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), inner_updates)
        return out_updates, jax.tree.map(keep, new_state, state)

    return optax.GradientTransformationExtraArgs(init, update)


def find_qsdp_state(opt_state: PyTree) -> QSDPState | None:
    """The single :class:`QSDPState` inside ``opt_state`` (also inside ``optax.chain``), or None."""
    found = [
        x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, QSDPState))
        if isinstance(x, QSDPState)
    ]
    if len(found) > 1:
        raise ValueError("opt_state holds more than one QSDPState: wrap the optimizer with qsdp() once")
    return found[0] if found else None


def snap_to_grid(params: PyTree, opt_state: PyTree, config: QSDPConfig) -> PyTree:
    """``params`` moved exactly onto the current grid held in ``opt_state``.

    After ``optax.apply_updates`` the projected leaves are on the grid up to float rounding;
    this makes them exact (the values a lossless all-gather reproduces bit for bit). Leaves
    without a grid are returned as they are.
    """
    st = find_qsdp_state(opt_state)
    if st is None or st.bits is None:
        return params
    ctx = current_context()
    leaves, treedef = jax.tree_util.tree_flatten(params)
    s_leaves = treedef.flatten_up_to(st.scales)
    o_leaves = treedef.flatten_up_to(st.offsets)
    out = []
    for x, s, o, b in zip(leaves, s_leaves, o_leaves, _bits_for(params, config, ctx)):
        if s.size == 0:
            out.append(x)
        else:
            out.append(_snap_leaf(x, s, o, _geometry(x, ctx is not None, st.bucket), config, b))
    return jax.tree_util.tree_unflatten(treedef, out)


def apply_updates(params: PyTree, updates: PyTree, opt_state: PyTree, config: QSDPConfig) -> PyTree:
    """``optax.apply_updates`` followed by :func:`snap_to_grid`: params exactly on the grid."""
    return snap_to_grid(optax.apply_updates(params, updates), opt_state, config)


def init_on_grid(params: PyTree, optimizer: optax.GradientTransformation, config: QSDPConfig):
    """``(params projected onto the initial grid, opt_state)`` for a single-device loop."""
    opt_state = optimizer.init(params)
    return snap_to_grid(params, opt_state, config), opt_state


_SAME_RESULT_FIELDS = ("kernels",)
"""Config fields that choose how, not what: every ``kernels`` mode computes the same bits, so the
optimizer and the step may differ in them (e.g. a reference optimizer with a Pallas step)."""


def check_same_config(opt_state: PyTree, config: QSDPConfig) -> None:
    """A clear error when ``opt_state`` was made by ``qsdp(base, other)`` with ``other !=
    config`` (naming the first differing field; fields in ``_SAME_RESULT_FIELDS`` may differ), or
    holds more than one QSDPState."""
    st = find_qsdp_state(opt_state)
    if st is None or st.config is None or st.config == config:
        return
    for f in dataclasses.fields(QSDPConfig):
        if f.name in _SAME_RESULT_FIELDS:
            continue
        a, b = getattr(st.config, f.name), getattr(config, f.name)
        if a != b:
            raise ValueError(
                f"the optimizer was built with QSDPConfig.{f.name}={a!r} but the train step's "
                f"config has {f.name}={b!r}: build both from the same QSDPConfig"
            )
