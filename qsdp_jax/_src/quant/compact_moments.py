"""Optimizer moments stored in bfloat16, rounded stochastically (:func:`compact_moments`).

Adam's second moment is an exponential average ``nu <- b2 nu + (1 - b2) g^2``. With
``b2 = 0.999`` each step moves it by about 0.1% of itself, less than half of a bfloat16 step
(2^-8 relative): stored with round-to-nearest, a slowly varying ``nu`` never moves at all. Here
the new state is rounded to one of its two bfloat16 neighbours with the probability that makes
the stored value unbiased (``E[stored] = new``), so the average keeps following its input.

Randomness, as everywhere in qsdp_jax, is a pure function of integers: the bits of element ``e``
of the inner state's leaf ``i`` (its index among all the state's leaves) at update ``count`` are
``hash(derive_key(seed, MOMENTS, count, i), e)``, ``e`` the element's row-major index in the
global leaf (modulo 2^32). A sharded run therefore rounds exactly
as a one-device run, and a resumed run as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsdp_jax._src.quant import randomness
from qsdp_jax._src.layout.state_specs import param_shaped_leaves

PyTree = Any
PURPOSE_MOMENTS = 3
DTYPES = ("bfloat16",)


def element_ids(shape: tuple[int, ...]) -> jax.Array:
    """uint32 row-major index of every element of an array of ``shape`` (wrapping past 2^32)."""
    ids = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        ids = ids + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    return ids


def stochastic_bfloat16(x: jax.Array, key: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to bfloat16 stochastically: away from zero with probability equal
    to the fraction of a bfloat16 step by which ``|x|`` exceeds its lower neighbour, so
    ``E[result] = x`` (subnormals included). Values already on bfloat16, zeros, infinities and
    NaN are unchanged; a finite ``|x|`` above the largest finite bfloat16 (3.39e38) becomes that
    value, never infinity (the one place the rounding is biased)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    counters = element_ids(x.shape) + jnp.asarray(key, jnp.uint32) * jnp.uint32(randomness.GOLDEN)
    noise = randomness.mix32(randomness.mix32(counters) ^ key) >> 16
    up = (bits + noise) & jnp.uint32(0xFFFF0000)
    sign = bits & jnp.uint32(0x80000000)
    overflow = (up & jnp.uint32(0x7FFFFFFF)) == jnp.uint32(0x7F800000)  # a finite x rounded to inf
    up = jnp.where(overflow, sign | jnp.uint32(0x7F7F0000), up)
    rounded = jnp.where(jnp.isfinite(x), up, bits)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompactMomentsState:
    """State of :func:`compact_moments`.

    Attributes:
      count: number of updates so far (int32), keys the rounding.
      inner: the inner transformation's state, its parameter-shaped leaves in bfloat16 (the
        leaves stored in bfloat16 are the compacted ones: no other metadata, so that
        ``optax.tree_map_params``, which calls ``init`` on placeholders, sees the same tree).
    """

    count: jax.Array
    inner: PyTree


def compact_moments(
    inner: optax.GradientTransformation, dtype: str = "bfloat16", seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """Store ``inner``'s per-parameter state (adam's ``mu`` and ``nu``, a momentum trace) in
    ``dtype``, rounded stochastically; compute in float32.

    A state leaf is compacted when it is float32 and shaped like a parameter whose key path its
    own ends with (the rule that also shards it like that parameter): counts, hyperparameters
    (``inject_hyperparams``) and factored statistics (Adafactor) stay as they are. Inside this
    wrapper, ``optax.MultiSteps``'s gradient accumulator is parameter-shaped too and is
    compacted (accumulated in stochastically rounded bfloat16); wrap ``MultiSteps`` around
    ``compact_moments`` to accumulate in float32. Each update casts the bfloat16 leaves of the stored state to float32, runs
    ``inner.update`` and rounds those leaves back (:func:`stochastic_bfloat16`); a leaf ``inner``
    itself keeps in bfloat16 (``mu_dtype=jnp.bfloat16``) is thus rounded by ``inner`` first. Adam's state then takes 4 bytes per parameter
    instead of 8. Wrap the base optimizer before :func:`qsdp_jax.optim.qsdp`:
    ``qsdp(compact_moments(optax.adamw(3e-4)), config)``.

    Args:
      inner: any optax transformation.
      dtype: the stored dtype; only ``"bfloat16"``.
      seed: keys the rounding (use the run's seed).

    Raises:
      ValueError: an unknown ``dtype``, or a ``seed`` that is not an int in ``[0, 2**32)``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"compact_moments dtype={dtype!r} is invalid: must be one of {DTYPES}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"compact_moments seed={seed!r} is invalid: must be an int in [0, 2**32)")
    inner = optax.with_extra_args_support(inner)

    def init(params):
        state = inner.init(params)
        compact = [
            keep and leaf.dtype == jnp.float32
            for leaf, keep in zip(jax.tree_util.tree_leaves(state), param_shaped_leaves(state, params))
        ]
        return CompactMomentsState(count=jnp.zeros((), jnp.int32), inner=_store(state, compact, 0, seed))

    def update(updates, state: CompactMomentsState, params=None, **extra_args):
        leaves, treedef = jax.tree_util.tree_flatten(state.inner)
        # the leaves init compacted: parameter-shaped (``updates`` has the params' paths and
        # shapes) and stored in bfloat16
        shaped = param_shaped_leaves(state.inner, updates)
        compact = [keep and x.dtype == jnp.bfloat16 for x, keep in zip(leaves, shaped)]
        wide = [x.astype(jnp.float32) if c else x for x, c in zip(leaves, compact)]
        new_updates, new_inner = inner.update(
            updates, jax.tree_util.tree_unflatten(treedef, wide), params, **extra_args
        )
        count = state.count + 1
        return new_updates, CompactMomentsState(count=count, inner=_store(new_inner, compact, count, seed))

    return optax.GradientTransformationExtraArgs(init, update)


def _store(state: PyTree, compact: list[bool], count, seed: int) -> PyTree:
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if len(leaves) != len(compact):
        raise ValueError(
            f"compact_moments: the inner state has {len(leaves)} leaves after an update but "
            f"{len(compact)} at init; its structure must not change"
        )
    out = [
        stochastic_bfloat16(x, randomness.derive_key(seed, PURPOSE_MOMENTS, count, i)) if c else x
        for i, (x, c) in enumerate(zip(leaves, compact))
    ]
    return jax.tree_util.tree_unflatten(treedef, out)
