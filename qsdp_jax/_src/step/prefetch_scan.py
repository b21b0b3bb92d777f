"""The layer scan with the next layer's gather in flight while this layer computes: FSDP's
prefetch written into the program, for compilers that do not pipeline our gathers themselves.

:func:`prefetch_scan` computes what :func:`~qsdp_jax._src.step.layer_scan.remat_scan` computes
for ``layer(c, (blocks, x), k) = body(c, gather(blocks, k), x, k)``: the same values and the
same gradients, from the same arithmetic (the same gathers, keys and reduce-scatters). What
differs is which iteration of the loops issues each collective:

* **forward**: iteration ``i`` gathers layer ``i + 1`` (its carry holds layer ``i``'s gathered
  weights, gathered by iteration ``i - 1``); nothing in iteration ``i`` reads that gather, so a
  compiler that runs collectives asynchronously can run it under layer ``i``'s matmuls. The last
  iteration gathers layer ``n - 1`` again: the backward pass starts with it.
* **backward** (reverse): iteration ``i`` gathers layer ``i - 1`` and reduce-scatters layer
  ``i + 1``'s weight gradient (computed by iteration ``i + 1``) while it takes layer ``i``'s
  VJP; the last layer's reduce-scatter (layer 0) runs after the loop.

The price: one more layer's gathered weights in each loop (the prefetched layer beside the one
computing) and, in the backward loop, one layer's full weight gradient carried to the next
iteration; the layer gathered at the end of the forward is held until the backward starts. The
loops' uniform bodies cost two collectives that carry nothing: the backward's last iteration
gathers layer 0 again, and its first reduce-scatters a zero gradient (of layer ``n - 1``, whose
slot the next iteration overwrites); the forward's extra gather of layer ``n - 1`` is the one the
backward uses instead of gathering it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from qsdp_jax._src.collective.regather import tie, tied
from qsdp_jax._src.layout.alike import apart as apart_items, pick
from qsdp_jax._src.step.layer_scan import at, cotangents, first, floats, with_floats, zero_ct

PyTree = Any


def prefetch_scan(
    gather: Callable[[Any, Any], PyTree],
    body: Callable[[Any, PyTree, Any, Any], tuple[Any, Any]],
    init,
    blocks,
    xs,
    consts,
    *,
    apart: bool = False,
) -> tuple[Any, Any]:
    """``remat_scan`` of ``body(c, gather(blocks_l, k_l), x_l, k_l)`` over the layers, with
    layer ``i + 1``'s gather issued in iteration ``i`` (module docstring).

    Args:
      gather: ``gather(blocks_l, k_l) -> weights``, differentiable in ``blocks_l`` (its backward
        reduce-scatters); it may close over values of the enclosing trace.
      body: ``body(carry, weights, x_l, k_l) -> (carry, y)``; it may close over values too.
      init: the initial carry.
      blocks: this device's blocks, with a leading layer axis, or (``apart``) a list over the
        layers; differentiated (their float leaves).
      xs: per-layer inputs with a leading layer axis, differentiated (their float leaves), or None.
      consts: per-layer inputs with a leading layer axis, not differentiated.
      apart: ``blocks`` is a list over the layers; their gradients come back as such a list.

    Returns:
      ``(carry, ys)`` as ``lax.scan`` returns them.
    """
    n = len(blocks) if apart else jax.tree_util.tree_leaves(blocks)[0].shape[0]
    b0 = pick(blocks, 0) if apart else first(blocks)
    gfn, g_hoisted = jax.closure_convert(gather, b0, first(consts))
    w0 = jax.tree_util.tree_map(
        lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(gfn, b0, first(consts), *g_hoisted)
    )
    bfn, b_hoisted = jax.closure_convert(body, init, w0, first(xs), first(consts))
    return _make_run(gfn, bfn, n, apart)(init, blocks, xs, consts, tuple(g_hoisted), tuple(b_hoisted))


def _make_run(gfn, bfn, n: int, apart: bool):
    take = pick if apart else at

    def gather_at(blocks, consts, g_h, i):
        return gfn(take(blocks, i), at(consts, i), *g_h)

    def scatter(blocks, consts, g_h, i, ct_w):
        """The gather's VJP at layer ``i`` (its reduce-scatter; the gather itself is unused)."""
        b_i, k_i = take(blocks, i), at(consts, i)

        def g(bf, hf):
            return floats(gfn(with_floats(b_i, bf), k_i, *with_floats(g_h, hf)))

        _, vjp = jax.vjp(g, floats(b_i), floats(g_h))
        return vjp(ct_w)

    def forward(init, blocks, xs, consts, g_h, b_h, keep: bool):
        def step(state, i):
            c, w = state
            w_next = gather_at(blocks, consts, g_h, jnp.minimum(i + 1, n - 1))
            c2, y = bfn(c, w, at(xs, i), at(consts, i), *b_h)
            return (c2, w_next), ((y, c) if keep else y)

        start = (init, gather_at(blocks, consts, g_h, 0))
        return lax.scan(step, start, jnp.arange(n, dtype=jnp.int32))

    @jax.custom_vjp
    def run(init, blocks, xs, consts, g_h, b_h):
        (carry, _), ys = forward(init, blocks, xs, consts, g_h, b_h, False)
        return carry, ys

    def fwd(init, blocks, xs, consts, g_h, b_h):
        (carry, w_last), (ys, carries) = forward(init, blocks, xs, consts, g_h, b_h, True)
        return (carry, ys), (carries, blocks, xs, consts, g_h, b_h, w_last)

    def bwd(res, ct):
        carries, blocks, xs, consts, g_h, b_h, w_last = res
        ct_carry, ct_ys = ct
        t = tie((ct_carry, ct_ys))

        def zeros(tree, stacked: bool) -> list:  # made when the backward starts (layer_scan)
            return tied([jnp.zeros((n, *x.shape) if stacked else x.shape, x.dtype) for x in floats(tree)], t)

        b0 = pick(blocks, 0) if apart else first(blocks)
        state0 = (
            floats(ct_carry),
            w_last,
            zeros(w_last, False),  # the gradient of layer i + 1's weights, not yet scattered
            zeros(b0, True),
            zeros(first(xs), True),
            zeros(g_h, False),
            zeros(b_h, False),
        )
        ct_y_floats = floats(ct_ys)

        def step(state, i):
            ct_cf, w, pending, b_bufs, x_bufs, gh_cts, bh_cts = state
            j = jnp.minimum(i + 1, n - 1)  # at i = n - 1: zeros into a slot the next step overwrites
            ct_bj, ct_ghj = scatter(blocks, consts, g_h, j, pending)
            w_prev = gather_at(blocks, consts, g_h, jnp.maximum(i - 1, 0))
            c_l, x_l, k_l = at(carries, i), at(xs, i), at(consts, i)

            def diff(cf, wf, xf, hf):
                c2, y = bfn(with_floats(c_l, cf), with_floats(w, wf), with_floats(x_l, xf), k_l, *with_floats(b_h, hf))
                return floats(c2), floats(y)

            _, vjp = jax.vjp(diff, floats(c_l), floats(w), floats(x_l), floats(b_h))
            ct_yf = [lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in ct_y_floats]
            ct_cf, ct_w, ct_x, ct_bh = vjp((ct_cf, ct_yf))
            b_bufs = [lax.dynamic_update_index_in_dim(b, v, j, 0) for b, v in zip(b_bufs, ct_bj)]
            x_bufs = [lax.dynamic_update_index_in_dim(b, v, i, 0) for b, v in zip(x_bufs, ct_x)]
            gh_cts = [a + v for a, v in zip(gh_cts, ct_ghj)]
            bh_cts = [a + v for a, v in zip(bh_cts, ct_bh)]
            return (ct_cf, w_prev, ct_w, b_bufs, x_bufs, gh_cts, bh_cts), None

        state, _ = lax.scan(step, state0, jnp.arange(n, dtype=jnp.int32), reverse=True)
        ct_cf, _, pending, b_bufs, x_bufs, gh_cts, bh_cts = state
        ct_b0, ct_gh0 = scatter(blocks, consts, g_h, 0, pending)  # layer 0's, after the loop
        b_bufs = [lax.dynamic_update_index_in_dim(b, v, 0, 0) for b, v in zip(b_bufs, ct_b0)]
        gh_cts = [a + v for a, v in zip(gh_cts, ct_gh0)]
        ct_blocks = (
            [cotangents(b, per) for b, per in zip(blocks, apart_items(b_bufs, n))]
            if apart
            else cotangents(blocks, b_bufs)
        )
        return (
            cotangents(ct_carry, ct_cf),
            ct_blocks,
            cotangents(xs, x_bufs),
            jax.tree_util.tree_map(zero_ct, consts),
            cotangents(g_h, gh_cts),
            cotangents(b_h, bh_cts),
        )

    run.defvjp(fwd, bwd)
    return run
