"""``qsdp_jax._src.layout.alike``: an item of a list picked by a traced index, and stacked arrays
sliced apart, as plain indexing does; integers XLA cannot fold, equal to themselves."""

import jax
import jax.numpy as jnp
import numpy as np

import pytest

from qsdp_jax._src.layout.alike import apart, opaque_ints, pick


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


@pytest.mark.optimized  # XLA's default optimizations: they must not fold or reorder the values
@pytest.mark.parametrize("data", [0, -5, 2**31 - 1])
def test_opaque_ints_are_the_given_ints_in_order(data):
    values = [0, 1, 3, 4, 17]  # not a range: a caller's leaf indices skip the leaves it leaves out
    got = jax.jit(lambda d: opaque_ints(values, d))(jnp.int32(data))
    assert [int(v) for v in got] == values
    assert opaque_ints([], jnp.int32(data)) == []
