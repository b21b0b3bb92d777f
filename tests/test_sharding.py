"""Meshes and the flat sharded layout."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import qsdp_jax as q
from qsdp_jax.sharding import FlatLayout, check_mesh


def _params():
    r = np.random.default_rng(0)
    return {
        "odd": {"m": jnp.asarray(r.normal(size=(7, 13)), jnp.float32)},
        "mixed": {"w": jnp.asarray(r.normal(size=(40, 30)), jnp.float32),
                  "b": jnp.asarray(r.normal(size=(30,)), jnp.float32),
                  "ids": jnp.arange(5)},
        "blocks": {"w": jnp.asarray(r.normal(size=(3, 20, 20)), jnp.float32),
                   "s": jnp.asarray(r.normal(size=(3, 20)), jnp.float32)},
    }


def test_make_mesh_over_all_devices():
    mesh = q.make_mesh()
    assert mesh.axis_names == ("fsdp",)
    assert mesh.shape["fsdp"] == jax.device_count() == 8
    assert check_mesh(mesh, "fsdp") == 8
    assert q.make_mesh("x", jax.devices()[:2]).shape["x"] == 2


def test_mesh_errors():
    mesh = q.make_mesh("data")
    with pytest.raises(ValueError, match=r"no axis 'fsdp'.*\('data',\)"):
        check_mesh(mesh, "fsdp")
    two_d = Mesh(np.array(jax.devices()).reshape(2, 4), ("node", "fsdp"))
    with pytest.raises(ValueError, match=r"1-D meshes only.*hierarchy\.mesh_sizes"):
        check_mesh(two_d, "fsdp")
    with pytest.raises(TypeError):
        check_mesh("fsdp", "fsdp")
    with pytest.raises(ValueError, match="at least one device"):
        q.make_mesh(devices=[])


def test_layout_places_leaves_and_pads():
    lay = FlatLayout.create(_params(), num_shards=8, bucket=16, min_shard_size=64, stacked=("blocks",))
    odd = lay.group("odd")
    assert odd.slots[0].size == 91 and odd.flat_size == 128 and odd.chunk == 16  # 7x13 on 8 devices
    mixed = lay.group("mixed")
    assert [s.size for s in mixed.slots] == [1200]
    assert len(mixed.replicated) == 2  # the bias (30 < 64) and the integer leaf
    blocks = lay.group("blocks")
    assert blocks.stacked and blocks.n_layers == 3
    assert [s.size for s in blocks.slots] == [400] and blocks.flat_size == 512
    # every leaf starts on a bucket boundary, every device holds whole buckets
    for g in lay.groups:
        assert all(s.offset % 16 == 0 for s in g.slots)
        assert g.flat_size % (8 * 16) == 0


def test_flatten_unflatten_roundtrip_and_sharding():
    params = _params()
    mesh = q.make_mesh()
    lay = FlatLayout.create(params, 8, 16, 64, stacked=("blocks",))
    flat = jax.jit(lay.flatten, out_shardings=lay.shardings(mesh, "fsdp"))(params)
    assert flat["sharded"]["odd"].shape == (128,)
    assert flat["sharded"]["blocks"].shape == (3, 512)
    shard_shapes = {s.data.shape for s in flat["sharded"]["blocks"].addressable_shards}
    assert shard_shapes == {(3, 64)}
    assert flat["replicated"]["mixed"][0].sharding.is_fully_replicated
    chex.assert_trees_all_equal(lay.unflatten(flat), params)
    # one layer of a stacked group
    layer = lay.unflatten_group("blocks", flat["sharded"]["blocks"][1],
                                tuple(x[1] for x in flat["replicated"]["blocks"]))
    chex.assert_trees_all_equal(layer, jax.tree.map(lambda x: x[1], params["blocks"]))


@pytest.mark.parametrize("lead", [(), (3,)])
def test_split_flat_gradient_matches_slicing_and_is_one_concatenation(lead):
    from qsdp_jax.sharding import split_flat

    spans = ((0, 5), (8, 3), (16, 10))  # gaps between pieces and after the last
    flat = jnp.asarray(np.random.default_rng(1).normal(size=(*lead, 32)), jnp.float32)
    w = [jnp.asarray(np.random.default_rng(i).normal(size=(*lead, n)), jnp.float32) for i, (_, n) in enumerate(spans)]

    def loss(split):
        return lambda f: sum(jnp.sum(jnp.sin(x) * wi) for x, wi in zip(split(f), w))

    def sliced(f):
        return tuple(f[..., o : o + n] for o, n in spans)

    got = jax.grad(loss(lambda f: split_flat(f, spans)))(flat)
    chex.assert_trees_all_close(got, jax.grad(loss(sliced))(flat), rtol=1e-6)
    assert not np.asarray(got)[..., 5:8].any() and not np.asarray(got)[..., 26:].any()
    chex.assert_trees_all_equal(split_flat(flat, spans), sliced(flat))
    # the transpose of slicing pads every piece to the whole buffer; ours concatenates once
    jaxpr = str(jax.make_jaxpr(jax.grad(loss(lambda f: split_flat(f, spans))))(flat))
    assert " pad[" not in jaxpr and "concatenate" in jaxpr
    assert " pad[" in str(jax.make_jaxpr(jax.grad(loss(sliced)))(flat))


def test_layout_errors():
    with pytest.raises(ValueError, match="non-empty dict"):
        FlatLayout.create([1, 2], 8, 16, 0)
    with pytest.raises(ValueError, match=r"stacked groups \['nope'\]"):
        FlatLayout.create(_params(), 8, 16, 0, stacked=("nope",))
    bad = {"blocks": {"a": jnp.ones((3, 4)), "b": jnp.ones((2, 4))}}
    with pytest.raises(ValueError, match="same leading layer axis"):
        FlatLayout.create(bad, 8, 16, 0, stacked=("blocks",))
    lay = FlatLayout.create(_params(), 8, 16, 64)
    with pytest.raises(KeyError, match="unknown parameter group"):
        lay.group("nope")
    wrong = dict(_params(), odd={"m": jnp.ones((7, 13)), "extra": jnp.ones(3)})
    with pytest.raises(ValueError, match="leaves"):
        lay.flatten(wrong)


def test_layout_table_mentions_groups():
    lay = FlatLayout.create(_params(), 8, 16, 64, stacked=("blocks",))
    t = lay.table()
    assert "blocks" in t and "odd" in t and "128" in t
