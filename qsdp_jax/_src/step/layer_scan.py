"""The rematerialised layer scan of ``ParamAccess.scan``, with a backward pass of its own.

:func:`remat_scan` is ``lax.scan(jax.checkpoint(layer), init, xs)``: the same values, the same
gradients from the same arithmetic (the backward pass re-runs each layer, gathers included, and
takes its VJP, as remat does). What differs is *when* the backward's buffers exist. Transposing a
``lax.scan`` makes JAX build the per-layer gradient of every scanned input (the stacked weight
blocks: at GPT-1.3B on 8 devices, 2 x 201 MB for the MLP alone) in buffers initialised with
zeros that depend on nothing, and XLA:CPU allocated them at the start of the step, so they
were live through the whole forward pass, whose peak they raised. Here the backward loop
accumulates those gradients in buffers tied to the incoming cotangent (``zeros + 0 * c``), which
cannot exist before the backward pass begins (GPT-1.3B, 8 devices: the fp32 step's peak 4162 ->
3951 MB, below the plain GSPMD step's 4065).

The layer may close over values of the enclosing trace (a mask, another group's weights): they
are hoisted with ``jax.closure_convert`` and get their gradient, summed over the layers.
With ``apart=True`` the per-layer inputs come as a list over the layers (separate arrays, e.g.
the blocks of an ``nnx.List``'s groups, :meth:`ShardedParams.chain`): each iteration picks its
layer's with a ``lax.switch`` whose branches return one layer's each, so they are never stacked
(a stacked copy of every block, for the forward and again for the backward, raised a 4-block
list GPT's peak 1.14x over the stacked model's); their gradients come back as a list.

Only floating-point leaves are differentiated; integer leaves (indices, PRNG keys, codes) get
zero (``float0``) cotangents. A NaN or Inf in the cotangent gives the gradient plain autodiff
gives (every layer's slot of the buffers is overwritten with its computed gradient).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qsdp_jax._src.layout.alike import apart as apart_items, pick
from qsdp_jax._src.collective.regather import tie, tied

PyTree = Any


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def zero_ct(x):
    """The zero cotangent of a primal leaf: float0 for a non-float one."""
    if _is_float(x):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def floats(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if _is_float(x)]


def with_floats(tree, floats: list):
    """``tree`` with its float leaves replaced, in order, by ``floats``."""
    it = iter(floats)
    return jax.tree_util.tree_map(lambda x: next(it) if _is_float(x) else x, tree)


def cotangents(tree, float_cts: list):
    """Cotangents shaped like ``tree``: ``float_cts`` at its float leaves, float0 zeros elsewhere."""
    it = iter(float_cts)
    return jax.tree_util.tree_map(lambda x: next(it) if _is_float(x) else zero_ct(x), tree)


def first(tree):
    return jax.tree_util.tree_map(lambda a: a[0], tree)


def at(tree, i):
    return jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def remat_scan(
    layer: Callable[[Any, Any, Any], tuple[Any, Any]], init, xs, consts, *, apart: bool = False
) -> tuple[Any, Any]:
    """``lax.scan(jax.checkpoint(lambda c, x: layer(c, *x)), init, (xs, consts))`` whose backward
    pass creates its gradient buffers when it starts (module docstring).

    Args:
      layer: ``layer(carry, x, const) -> (carry, y)`` for one layer's slices of ``xs`` and
        ``consts``; it may close over values of the enclosing trace.
      init: the initial carry.
      xs: per-layer inputs with a leading layer axis, differentiated (their float leaves).
      consts: per-layer inputs with a leading layer axis that are not differentiated (grids,
        codes, layer indices).
      apart: ``xs`` is a list over the layers of per-layer trees (module docstring); their
        gradients come back as such a list.

    Returns:
      ``(carry, ys)`` as ``lax.scan`` returns them.
    """
    n = len(xs) if apart else jax.tree_util.tree_leaves(xs)[0].shape[0]
    fn, hoisted = jax.closure_convert(layer, init, xs[0] if apart else first(xs), first(consts))
    return _make_run(fn, n, apart)(init, xs, consts, tuple(hoisted))


def _make_run(fn, n: int, apart: bool):
    layer_of = pick if apart else at

    def scan_forward(init, xs, consts, hoisted, keep_carries: bool):
        def step(c, i):
            c2, y = fn(c, layer_of(xs, i), at(consts, i), *hoisted)
            return c2, ((y, c) if keep_carries else y)

        return lax.scan(step, init, jnp.arange(n, dtype=jnp.int32))

    @jax.custom_vjp
    def run(init, xs, consts, hoisted):
        return scan_forward(init, xs, consts, hoisted, False)

    def fwd(init, xs, consts, hoisted):
        carry, (ys, carries) = scan_forward(init, xs, consts, hoisted, True)
        return (carry, ys), (carries, xs, consts, hoisted)

    def bwd(res, ct):
        carries, xs, consts, hoisted = res
        ct_carry, ct_ys = ct
        t = tie((ct_carry, ct_ys))  # float0 cotangents are not floating: skipped
        # the gradient buffers, per layer (n, ...): from when the backward starts
        bufs = tied([jnp.zeros((n, *x.shape), x.dtype) for x in floats(xs[0] if apart else first(xs))], t)
        h_cts = tied([jnp.zeros_like(h) for h in floats(hoisted)], t)
        ct_y_floats = floats(ct_ys)

        def step(state, i):
            ct_cf, bufs, h_cts = state
            c_l, x_l, k_l = at(carries, i), layer_of(xs, i), at(consts, i)
            ct_yf = [lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in ct_y_floats]

            def diff(cf, xf, hf):
                c2, y = fn(with_floats(c_l, cf), with_floats(x_l, xf), k_l, *with_floats(hoisted, hf))
                return floats(c2), floats(y)

            _, vjp = jax.vjp(diff, floats(c_l), floats(x_l), floats(hoisted))
            ct_cf, ct_xf, ct_hf = vjp((ct_cf, ct_yf))
            bufs = [lax.dynamic_update_index_in_dim(b, v, i, 0) for b, v in zip(bufs, ct_xf)]
            h_cts = [a + v for a, v in zip(h_cts, ct_hf)]
            return (ct_cf, bufs, h_cts), None

        state = (floats(ct_carry), bufs, h_cts)
        (ct_cf, bufs, h_cts), _ = lax.scan(step, state, jnp.arange(n, dtype=jnp.int32), reverse=True)
        zero_consts = jax.tree_util.tree_map(zero_ct, consts)
        if apart:
            ct_xs = [cotangents(x, per) for x, per in zip(xs, apart_items(bufs, n))]
        else:
            ct_xs = cotangents(xs, bufs)
        return cotangents(ct_carry, ct_cf), ct_xs, zero_consts, cotangents(hoisted, h_cts)

    run.defvjp(fwd, bwd)
    return run
