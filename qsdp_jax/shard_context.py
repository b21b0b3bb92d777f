"""What the optimizer knows of the ``shard_map`` it runs in, and the reductions that need it.

The sharded train step declares, while it traces, which params leaves are local shards of flat
buffers (:func:`sharding_context`); :mod:`qsdp_jax.optim` reads it to give buckets global ids,
and the reductions here use it to answer for the *global* tree rather than one device's
shards: :func:`all_finite` (the non-finite-step guard) and :func:`global_norm` /
:func:`clip_by_global_norm` (what ``optax.clip_by_global_norm`` gets wrong inside the step).
Outside a sharding context every function here is the plain single-device one.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

PyTree = Any


class ShardContext(NamedTuple):
    axis_name: str
    num_shards: int
    mask: PyTree  # bool per params leaf: True = a local shard of a flat buffer (last axis)
    bits: tuple | None = None  # weight bits per params leaf (a bit policy's); None: the config's


_CONTEXT: contextvars.ContextVar[ShardContext | None] = contextvars.ContextVar(
    "qsdp_shard_context", default=None
)


@contextlib.contextmanager
def sharding_context(axis_name: str, num_shards: int, mask: PyTree, bits: tuple | None = None):
    """Declare, while tracing inside ``shard_map``, which params leaves are local shards (and,
    with a ``QSDPConfig.bit_policy``, the weight bits of each leaf, in ``tree_leaves`` order)."""
    token = _CONTEXT.set(ShardContext(axis_name, num_shards, mask, bits))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> ShardContext | None:
    """The innermost :func:`sharding_context` being traced, or None outside one."""
    return _CONTEXT.get()


def all_finite(tree: PyTree) -> jax.Array:
    """True when every float in ``tree`` is finite; inside :func:`sharding_context`, on every
    device of the axis (the same answer everywhere)."""
    ctx = _CONTEXT.get()
    bad = sum(
        jnp.sum(~jnp.isfinite(x)).astype(jnp.int32)
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    )
    bad = jnp.asarray(bad, jnp.int32)
    if ctx is not None:
        bad = lax.psum(bad, ctx.axis_name)
    return bad == 0


def global_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of ``tree``; inside the sharded train step (:func:`sharding_context`), of the
    *global* tree: the local shards' squares are summed over the devices, replicated leaves
    counted once. (``optax.global_norm`` there sees only this device's shards.)"""
    ctx = _CONTEXT.get()
    leaves = jax.tree_util.tree_leaves(tree)
    if ctx is None:
        return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))
    mask = jax.tree_util.tree_leaves(ctx.mask)
    if len(mask) != len(leaves):
        raise ValueError("sharding_context mask does not match the updates' structure")
    sq = lambda xs: jnp.asarray(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in xs), jnp.float32)  # noqa: E731
    sharded = lax.psum(sq([x for x, m in zip(leaves, mask) if m]), ctx.axis_name)
    return jnp.sqrt(sharded + sq([x for x, m in zip(leaves, mask) if not m]))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` that is correct inside the sharded train step.

    optax's version computes the norm of what it is given, which in the sharded step is one
    device's shards: every device then clips by a different factor, and replicated leaves
    drift apart across devices. This one uses :func:`global_norm` (the same result as optax's
    outside the step).
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} is invalid: must be > 0")

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda u: (u * factor).astype(u.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
