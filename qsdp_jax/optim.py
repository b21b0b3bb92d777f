"""Optax transformations for QSDP: keep the weights on a randomly shifted quantization grid.

``qsdp(base, config)`` wraps any optax transformation. After the base update, each gridded
leaf's new value ``params + u`` is projected onto a fresh grid (per-bucket min/max; stochastic
rounding, or the paper's random shift, per ``config.weight_rounding``; unbiased either way) and
the returned update is ``projected - params``. So ``optax.apply_updates(params, updates)`` lands
on the grid up to float rounding; :func:`snap_to_grid` lands on it exactly (the sharded train
step does this, which makes its weight all-gather lossless). A leaf whose base update is zero
everywhere (a frozen leaf, an ``optax.MultiSteps`` micro-step) keeps its values and its grid.

**The optimizer sees global arrays.** In the sharded train step (``qsdp_jax.make_train_step``)
the base transformation runs on the model's own pytree of global, sharded arrays, outside any
``shard_map``: every optax transformation (``clip_by_global_norm``, LAMB, LARS, Adafactor, Muon,
masks keyed on the params' structure) computes exactly what it computes on one device, XLA adding
the cross-device reductions a norm needs. Only the projection and snap run per device, on the
buckets of each device's shard (:mod:`qsdp_jax._src.quant.grid`); bucket ids are global.

In a plain single-device loop every floating leaf with at least ``config.min_shard_size``
elements is kept on its grid; smaller leaves are updated in full precision.

A step whose gradients hold NaN or Inf returns zero updates and the unchanged state.
Randomness: the grid of bucket ``b`` of leaf ``i`` after update ``count`` is keyed by
``hash(derive_key(seed, WEIGHT, count, i), b)``, a pure function of the run's seed and position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from qsdp_jax._src.quant import grid as qgrid
from qsdp_jax.config import QSDPConfig, check_config
from qsdp_jax._src.quant.grid import layout_context  # noqa: F401  (re-exported: ``optim.layout_context``)
from qsdp_jax._src.quant.payload import cpu_boundary
from qsdp_jax._src.quant.compact_moments import (  # noqa: F401  (re-exported)
    CompactMomentsState,
    compact_moments,
    stochastic_bfloat16,
)

PyTree = Any
PURPOSE_WEIGHT = qgrid.PURPOSE_WEIGHT

clip_by_global_norm = optax.clip_by_global_norm
"""``optax.clip_by_global_norm`` (an alias kept for older scripts): the optimizer sees global
arrays in the sharded step, so optax's own clip is exact there."""


def all_finite(tree: PyTree) -> jax.Array:
    """True when every float in ``tree`` is finite (over the global arrays)."""
    # jnp.all over a bool, not a sum of int32s: XLA:CPU materialised the int32 conversion of
    # every leaf (a full-size s32 copy) before reducing it.
    ok = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not ok:
        return jnp.asarray(True)
    # The leaves' flags are and-ed behind a fusion boundary on CPU: XLA:CPU fused the and of all
    # of them into every leaf's update kernel (each `where(finite, new, old)`), code quadratic in
    # the leaves (a 6-block list GPT at W8G8: 82% of the step's LLVM IR).
    return cpu_boundary(jnp.all, jnp.stack(ok))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QSDPState:
    """State of :func:`qsdp`.

    A pytree (a registered dataclass): ``count``, ``scales``, ``offsets`` and ``inner`` are its
    children, the other fields static.

    Attributes:
      count: number of applied (finite) updates, an int32 scalar; keys the grid shifts.
      scales: the current grid's scale of every params leaf, per bucket (the params'
        structure; a zero-size array for leaves kept in full precision).
      offsets: the current grid's offset of every params leaf, per bucket (as ``scales``).
      inner: the base transformation's state.
      bits: static, the weight bits of the grid (``config.weight_bits`` in ``"qsdp"`` mode,
        None in the other modes: no grid); checked against the train step's config.
      bucket: static, ``config.bucket_size``; checked against the train step's config.
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
# The transformation
# ----------------------------------------------------------------------------------------------
def qsdp(base: optax.GradientTransformation, config: QSDPConfig) -> optax.GradientTransformationExtraArgs:
    """Wrap ``base`` so that parameters stay on QSDP's grid (weight_mode ``"qsdp"``).

    Args:
      base: any optax transformation; it sees the global params and gradients.
      config: the run's config (the train step refuses another).

    Returns:
      An optax transformation whose state is a :class:`QSDPState`; ``update`` needs ``params``
      in ``"qsdp"`` mode. With weight_mode ``"comm"`` or ``"full"`` the weights stay full
      precision and only the non-finite guard is added.

    Raises:
      TypeError: ``config`` is not a :class:`~qsdp_jax.QSDPConfig`.
      ValueError: from ``init``: ``base`` already holds a :class:`QSDPState` (wrapped twice);
        from ``update``: no ``params`` in ``"qsdp"`` mode.
    """
    check_config(config)
    base = optax.with_extra_args_support(base)
    projecting = config.weight_mode == "qsdp"

    def init(params):
        leaves, treedef = jax.tree_util.tree_flatten(params)
        count = jnp.zeros((), jnp.int32)
        inner = base.init(params)
        if find_qsdp_state(inner) is not None:
            raise ValueError(
                "the optimizer is wrapped with qsdp_jax.optim.qsdp() twice: wrap the base "
                "optimizer once (qsdp(base, config))"
            )
        scales = offsets = [qgrid.empty_grid()] * len(leaves)
        if projecting:
            _, scales, offsets = qgrid.project(leaves, qgrid.geometries(params, config), config, count)
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
        if projecting and params is None:
            raise ValueError("qsdp_jax.optim.qsdp needs params in update() to project onto the grid")
        # checked here too inside the train step (whose gradients are finite or zeroed): gating
        # every output on this flag keeps XLA:CPU from starting the updates early (without it
        # GPT-1.3B fp32 peaked 164 MB higher)
        finite = all_finite(updates)
        inner_updates, inner_state = base.update(updates, state.inner, params, **extra_args)
        count = state.count + 1
        scales, offsets = state.scales, state.offsets
        if projecting:
            inner_updates, scales, offsets = _project_updates(params, inner_updates, state, count, config)
        new_state = QSDPState(
            count=count,
            scales=scales,
            offsets=offsets,
            inner=inner_state,
            bits=state.bits,
            bucket=state.bucket,
            config=state.config,
        )
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        out_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), inner_updates)
        return out_updates, jax.tree.map(keep, new_state, state)

    return optax.GradientTransformationExtraArgs(init, update)


def _project_updates(params, updates, state: QSDPState, count, config: QSDPConfig):
    """The base updates replaced by ``projected - params``, and the new grids. A leaf whose
    update is zero everywhere keeps its values and grid."""
    treedef: Any  # a PyTreeDef: jaxlib ships no stubs for it, so a checker sees no methods
    leaves, treedef = jax.tree_util.tree_flatten(params)
    ups = treedef.flatten_up_to(updates)
    old_s, old_o = treedef.flatten_up_to(state.scales), treedef.flatten_up_to(state.offsets)
    geos = qgrid.geometries(params, config)
    moved = [p + u.astype(p.dtype) for p, u in zip(leaves, ups)]
    proj, new_s, new_o = qgrid.project(moved, geos, config, count)
    out_u, out_s, out_o = [], [], []
    for p, u, v, s, o, s0, o0 in zip(leaves, ups, proj, new_s, new_o, old_s, old_o):
        if v is None:
            out_u.append(u)
            out_s.append(s0)
            out_o.append(o0)
            continue
        still = ~jnp.any(u != 0)
        out_u.append(jnp.where(still, jnp.zeros_like(p), v - p))
        out_s.append(jnp.where(still, s0, s))
        out_o.append(jnp.where(still, o0, o))
    unflat = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)  # noqa: E731
    return unflat(out_u), unflat(out_s), unflat(out_o)


def find_qsdp_state(opt_state: PyTree) -> QSDPState | None:
    """The single :class:`QSDPState` inside ``opt_state`` (also inside ``optax.chain``), or None."""
    found = [
        x
        for x in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, QSDPState))
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
    treedef: Any  # a PyTreeDef (see _project_updates)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    out = qgrid.snap(
        leaves,
        qgrid.geometries(params, config),
        treedef.flatten_up_to(st.scales),
        treedef.flatten_up_to(st.offsets),
        config,
    )
    return jax.tree_util.tree_unflatten(treedef, out)


def apply_updates(params: PyTree, updates: PyTree, opt_state: PyTree, config: QSDPConfig) -> PyTree:
    """``optax.apply_updates`` followed by :func:`snap_to_grid`: params exactly on the grid.

    For a single-device loop (the sharded train step snaps by itself).

    Args:
      params: the params the updates were computed for.
      updates: the updates from the :func:`qsdp`-wrapped optimizer's ``update``.
      opt_state: the new optimizer state from that ``update`` (it holds the new grid; also
        inside ``optax.chain``).
      config: the run's config.

    Returns:
      The new params, leaves with a grid exactly on it, the others ``params + updates``
      (everything unchanged by the snap when ``opt_state`` holds no grid).

    Raises:
      ValueError: ``opt_state`` holds more than one :class:`QSDPState`.
    """
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
