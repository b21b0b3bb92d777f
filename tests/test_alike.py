"""``qsdp_jax._src.alike``: an item of a list picked by a traced index, and stacked arrays
sliced apart, as plain indexing does."""

import jax
import jax.numpy as jnp
import numpy as np

from qsdp_jax._src.alike import apart, pick


def test_pick_and_apart_are_indexing_and_differentiate():
    xs = [jnp.full((3,), float(k)) for k in range(5)]
    assert [float(jax.jit(pick)(xs, i)[0]) for i in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    grads = jax.grad(lambda xs: jnp.sum(pick(xs, 3) ** 2))(xs)
    np.testing.assert_array_equal(np.stack(grads), np.stack([2.0 * x if k == 3 else 0 * x for k, x in enumerate(xs)]))
    stacked = jnp.arange(20.0).reshape(5, 4)
    parts = jax.jit(lambda s: apart([s, 2 * s], 5))(stacked)
    for i, (a, b) in enumerate(parts):
        np.testing.assert_array_equal(a, stacked[i])
        np.testing.assert_array_equal(b, 2 * stacked[i])
