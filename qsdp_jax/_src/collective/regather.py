"""A call whose group is gathered for it and gathered again in its backward pass (PyTorch
FSDP2's ``reshard_after_forward``): :func:`regathered`, used by ``ParamAccess.call`` and the NNX
front door's resharded module calls (:mod:`qsdp_jax._src.nnx.reshard`).

``fn(gather(blocks), *inputs)`` runs inside a ``jax.custom_vjp`` whose residuals are the local
``blocks`` and the ``inputs``, never the gathered weights; the backward pass gathers again and
takes the gradient of the same function (same inputs and gradient keys: the same arithmetic as
``fn(gather(blocks), *inputs)`` without it, equal up to XLA's fusion choices). Two data
dependencies keep XLA from undoing it:

* the backward's gather takes ``blocks + 0 * c``, ``c`` one element of the incoming cotangent:
  without it XLA's common-subexpression pass merges it with the forward's gather (XLA:CPU drops
  remat's optimization barriers before CSE) and the weights stay alive across the step;
* the forward's gather takes ``blocks + 0 * x``, ``x`` one element of the *previous* call's
  inputs (``prefetch``): without it XLA hoists every gather to the start of the step; with it a
  gather may overlap the previous call, so at most two calls' weights are alive.

A NaN or Inf in ``c`` or ``x`` makes the blocks NaN, so the gradient is NaN and the step's
non-finite check skips it, as it would the NaN that caused it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

PyTree = Any


def tie(tree) -> jax.Array | None:
    """``0 * c`` (float32, no gradient), ``c`` the first element of a floating leaf of
    ``tree``; None when it has none."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size:
            return jax.lax.stop_gradient(0 * leaf.reshape(-1)[0].astype(jnp.float32))
    return None


def tied(blocks: list, t: jax.Array | None) -> list:
    """``blocks`` each plus ``t`` (a :func:`tie`): values XLA cannot compute before ``t`` exists;
    as they are when ``t`` is None."""
    return list(blocks) if t is None else [x + t.astype(x.dtype) for x in blocks]


def regathered(gather: Callable[[list], PyTree], fn: Callable[..., Any], blocks: list, inputs: tuple, prefetch=None):
    """``fn(gather(blocks), *inputs)``, gathered again in the backward pass (module docstring).

    Args:
      gather: ``blocks -> full weights`` (differentiable: its backward reduce-scatters).
      fn: the call; ``inputs`` (a tuple of pytrees of arrays) are its differentiable inputs.
      blocks: this device's blocks of the group's leaves.
      inputs: the call's inputs.
      prefetch: :func:`tie` of the previous call's inputs, or None.

    Returns:
      What ``fn`` returns (a pytree of arrays).
    """

    def run(b, xs):
        return fn(gather(b), *xs)

    @jax.custom_vjp
    def call(b, xs):
        return run(b, xs)

    def fwd(b, xs):
        return run(b, xs), (b, xs)

    def bwd(res, ct):
        b, xs = res
        _, vjp = jax.vjp(lambda b, xs: run(tied(b, tie(ct)), xs), b, xs)
        return vjp(ct)

    call.defvjp(fwd, bwd)
    return call(tied(blocks, prefetch), tuple(inputs))
