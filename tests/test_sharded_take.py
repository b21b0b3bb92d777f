"""``take_rows``: rows of a sharded table read from the devices' blocks, against ``jnp.take`` of
the whole table on one device (values bit for bit, gradients to float32 rounding), for a table
split on its rows and on a feature dimension, on 1-D, two-level and hybrid meshes, and for a
table with fewer rows than the devices' ids (gathered whole)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from qsdp_jax._src.collective.sharded_take import Split, take_rows

IDS_PER_DEVICE = (1, 3)  # 24 ids on 8 devices: fewer than the tables' rows


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def _ids(vocab, n_devices, seed=0, per_device=IDS_PER_DEVICE):
    ids = jax.random.randint(jax.random.key(seed), (n_devices * per_device[0], per_device[1]), 0, vocab)
    # negative ids count from the end; out-of-range ones give NaN rows and no gradient
    return ids.at[:4, 0].set(jnp.array([-1, vocab, -vocab - 1, 3 * vocab]))


def _sharded(mesh, table, ids, w, *, dim, axes, replica_axis=None):
    """``(rows, gradient of sum(rows * w))`` through ``take_rows``, the gradient taken inside
    ``shard_map`` as the train step takes it (each device's block's, summed over replicas)."""
    table_spec = P(*(axes if d == dim else None for d in range(table.ndim)))
    batch_axes = axes if replica_axis is None else (replica_axis, *np.atleast_1d(axes))
    n = int(np.prod([mesh.shape[a] for a in np.atleast_1d(axes)]))
    block_shape = tuple(s // n if d == dim else s for d, s in enumerate(table.shape))

    def local(block, ids, w):
        split = Split(block_shape, str(block.dtype), dim, table.shape[0], axes, replica_axis)
        rows, vjp = jax.vjp(lambda b: take_rows(b, b, ids, split), block)
        return rows, vjp(jnp.where(jnp.isnan(rows), 0, w).astype(rows.dtype))[0]

    body = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(table_spec, P(batch_axes), P(batch_axes)),
        out_specs=(P(batch_axes), table_spec),
        check_vma=False,
    )
    return body(table, ids, w)


def _reference(table, ids, w):
    def f(table):
        rows = jnp.take(table, ids, axis=0)
        return jnp.nansum(rows * w), rows

    (_, rows), grad = jax.value_and_grad(f, has_aux=True)(table)
    return rows, grad


CASES = {
    # name: (mesh shape, axis names, shard axes, replica axis, table shape, split dim)
    "rows-1d": ((8,), ("fsdp",), "fsdp", None, (64, 12), 0),
    "small-table-gathered": ((8,), ("fsdp",), "fsdp", None, (16, 12), 0),
    "small-table-gathered-features": ((2, 4), ("node", "fsdp"), ("node", "fsdp"), None, (20, 16), 1),
    "small-table-gathered-hybrid": ((2, 4), ("replica", "fsdp"), "fsdp", "replica", (8, 12), 0),
    "features-1d": ((8,), ("fsdp",), "fsdp", None, (60, 16), 1),
    "features-3d-table": ((8,), ("fsdp",), "fsdp", None, (30, 3, 16), 2),
    "rows-two-level": ((2, 4), ("node", "fsdp"), ("node", "fsdp"), None, (64, 12), 0),
    "features-two-level": ((2, 4), ("node", "fsdp"), ("node", "fsdp"), None, (60, 16), 1),
    "rows-hybrid": ((2, 4), ("replica", "fsdp"), "fsdp", "replica", (64, 12), 0),
    "features-hybrid": ((2, 4), ("replica", "fsdp"), "fsdp", "replica", (60, 16), 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_and_gradient_equal_take_of_the_whole_table(case):
    shape, names, axes, replica_axis, table_shape, dim = CASES[case]
    mesh = _mesh(shape, names)
    table = jax.random.normal(jax.random.key(1), table_shape)
    ids = _ids(table_shape[0], 8)
    w = jax.random.normal(jax.random.key(2), ids.shape + table_shape[1:])
    rows, grad = _sharded(mesh, table, ids, w, dim=dim, axes=axes, replica_axis=replica_axis)
    want_rows, want_grad = _reference(table, ids, w)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(want_rows))  # NaN where jnp.take's
    assert np.isnan(np.asarray(rows)[1:3, 0]).all() and not np.isnan(np.asarray(rows)[0, 0]).any()
    chex.assert_trees_all_close(grad, want_grad, rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(grad).sum()) > 0


def test_bfloat16_table_rows_exact_and_gradient_in_its_dtype():
    mesh = _mesh((8,), ("fsdp",))
    table = jax.random.normal(jax.random.key(1), (64, 12)).astype(jnp.bfloat16)
    ids = _ids(64, 8)
    w = jnp.ones(ids.shape + (12,), jnp.bfloat16)
    rows, grad = _sharded(mesh, table, ids, w, dim=0, axes="fsdp")
    want_rows, want_grad = _reference(table, ids, w)
    assert rows.dtype == jnp.bfloat16 and grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(want_rows, np.float32))
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(want_grad, np.float32))


def test_no_table_sized_buffer_in_either_pass():
    """The point of it: the compiled forward and backward hold rows and one block, never the
    table or a table-sized gradient (a gathered table would be ``f32[4096,16]``)."""
    mesh = _mesh((8,), ("fsdp",))
    table = jnp.zeros((4096, 16))
    ids = _ids(4096, 8)
    w = jnp.ones(ids.shape + (16,))
    hlo = lambda t: jax.jit(lambda t: _sharded(mesh, t, ids, w, dim=0, axes="fsdp")[1]).lower(t).compile().as_text()  # noqa: E731
    assert "f32[512,16]" in hlo(table)  # the block and its gradient
    assert "f32[4096,16]" not in hlo(table)
    assert "f32[16,16]" in hlo(jnp.zeros((16, 16)))  # a table smaller than the ids: gathered
