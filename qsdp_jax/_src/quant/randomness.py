"""Counter-based randomness shared by the jnp quantizers and the Pallas kernels.

Every random number of qsdp_jax is a pure function of integers: a key derived from (seed,
purpose, step, parameter index, ...) by :func:`derive_key`, hashed with a counter (element or
bucket id) by :func:`hash_uniform`. The same bits come out in jnp and inside a kernel, on every
device and backend, and a resumed run draws exactly what the uninterrupted one drew (DESIGN.md
section 2, invariant 5). Nothing here knows about quantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GOLDEN = 0x9E3779B9  # 2**32 / the golden ratio: the odd multiplier that spreads keys


def mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser (lowbias32): a bijection on uint32 with good avalanche."""
    x = jnp.asarray(x, jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return x


def derive_key(seed, *parts) -> jax.Array:
    """A uint32 key from a seed and integers (step, purpose, parameter index, layer, ...).

    Parts may be Python ints or traced integer scalars; the key is a pure function of them,
    never of host state or call order.
    """
    k = mix32(jnp.uint32(seed) ^ jnp.uint32(0x5EED5EED))
    for p in parts:
        p = jnp.asarray(p).astype(jnp.uint32)
        k = mix32(k ^ (p * jnp.uint32(GOLDEN) + jnp.uint32(0x7F4A7C15)))
    return k


def hash_uniform(key: jax.Array, counter: jax.Array) -> jax.Array:
    """Uniform float32 in [0, 1) from a uint32 key and uint32 counters (any shape)."""
    counter = jnp.asarray(counter).astype(jnp.uint32)
    key = jnp.asarray(key, jnp.uint32)
    return _uniform(counter + key * jnp.uint32(GOLDEN), key)


def hash_uniform_rows(key: jax.Array, row_ids: jax.Array, width: int) -> jax.Array:
    """``hash_uniform(key, row_ids[..., None] * width + arange(width))``, bit for bit: one
    uniform per element of rows of ``width`` elements numbered ``row_ids`` (bucket ids).

    The key is added to the small ``row_ids`` before they are spread over the rows. Spread
    first, the element counters do not depend on the key: inside a layer loop they are the same
    in every iteration, and XLA hoisted them out of the loop as one full-size uint32 array,
    live for the whole step (201 MB per device for a GPT-1.3B layer's gradient).
    """
    key = jnp.asarray(key, jnp.uint32)
    base = jnp.asarray(row_ids).astype(jnp.uint32) * jnp.uint32(width) + key * jnp.uint32(GOLDEN)
    return _uniform(base[..., None] + jnp.arange(width, dtype=jnp.uint32), key)


def _uniform(keyed_counter: jax.Array, key: jax.Array) -> jax.Array:
    h = mix32(mix32(keyed_counter) ^ key)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
