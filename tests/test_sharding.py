"""Meshes, the per-leaf sharding rule, and the copy-in/copy-out of the gather buffers."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import qsdp_jax as q
from jax.sharding import PartitionSpec as P

from qsdp_jax.sharding import check_mesh

from qsdp_jax.layout import ParamLayout, shard_dim


def _params():
    r = np.random.default_rng(0)
    return {
        "odd": {"m": jnp.asarray(r.normal(size=(7, 13)), jnp.float32)},
        "mixed": {
            "w": jnp.asarray(r.normal(size=(40, 30)), jnp.float32),
            "b": jnp.asarray(r.normal(size=(30,)), jnp.float32),
            "ids": jnp.arange(5),
        },
        "blocks": {
            "w": jnp.asarray(r.normal(size=(3, 20, 20)), jnp.float32),
            "s": jnp.asarray(r.normal(size=(3, 20)), jnp.float32),
        },
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


def test_layout_shards_each_leaf_on_its_first_dividing_dimension():
    with pytest.warns(
        UserWarning, match=r"blocks/w \(20, 20\).*odd/m \(7, 13\).*divide over 8 devices on no dimension"
    ):
        lay = ParamLayout.create(_params(), num_shards=8, bucket=16, min_shard_size=64, stacked=("blocks",))
    odd = lay.group("odd")
    assert not odd.leaves[0].sharded and not odd.buffers  # 7x13 divides nowhere: replicated
    mixed = lay.group("mixed")
    w = mixed.leaves[mixed.leaf_paths().index("mixed/w")]
    assert w.dim == 0 and w.local_size == 150 and w.buckets == 10  # (40, 30): 5 rows of 30 per device
    assert len(mixed.replicated) == 2  # the bias (30 < 64) and the integer leaf
    blocks = lay.group("blocks")
    assert blocks.stacked and blocks.n_layers == 3
    assert not blocks.leaves[blocks.leaf_paths().index("blocks/w")].sharded  # 20 x 20 over 8: no
    # (3, 20, 20) on 4 devices: the per-layer first dim 20 divides (the layer axis never is split)
    lay4 = ParamLayout.create({"blocks": _params()["blocks"]}, 4, 16, 64, stacked=("blocks",))
    bw = lay4.group("blocks").leaves[1]
    assert bw.dim == 0 and bw.local_size == 100 and bw.buckets == 7
    assert lay4.specs("fsdp")["blocks"]["w"] == P(None, "fsdp", None)
    specs = lay.specs("fsdp")
    assert specs["mixed"]["w"] == P("fsdp", None) and specs["mixed"]["b"] == P()
    assert specs["blocks"]["w"] == P() and specs["odd"]["m"] == P()
    # one buffer per group: every device packs its blocks, each padded to whole buckets
    (buf,) = mixed.buffers
    assert buf.chunk == 160 and buf.flat_size == 8 * 160
    assert all(s.offset % 16 == 0 for g in lay.groups for b in g.buffers for s in b.slots)


def test_shard_dim_rule():
    assert shard_dim((768, 3072), 8) == 0
    assert shard_dim((50257, 768), 8) == 1
    assert shard_dim((7, 13), 8) is None
    assert shard_dim((0, 8), 8) == 1


def test_pack_unpack_roundtrip_inside_shard_map():
    """Copy-in of every device's blocks, an all-gather, copy-out: the full leaves, exactly."""
    from qsdp_jax._src.layout import packing

    r = np.random.default_rng(3)
    params = {
        "g": {
            "a": jnp.asarray(r.normal(size=(16, 6)), jnp.float32),
            "b": jnp.asarray(r.normal(size=(5, 24)), jnp.float32),
            "c": jnp.asarray(r.normal(size=(2, 3, 8)), jnp.float32),
        }
    }
    lay = ParamLayout.create(params, 8, 16, 8)
    g = lay.group("g")
    assert [x.dim for x in g.leaves] == [0, 1, 2]
    mesh = q.make_mesh()
    placed = jax.device_put(params, lay.shardings(mesh, "fsdp"))

    def local(p):
        blocks = jax.tree.leaves(p["g"])
        (buf,) = g.buffers
        full = jax.lax.all_gather(packing.pack(buf, blocks, 16), "fsdp", tiled=True)
        leaves = [g.leaves[s.index] for s in buf.slots]
        pieces = packing.split_flat(full.reshape(8, buf.chunk), packing.spans(buf))
        got = packing.unpack(buf, pieces, 8, [x.dim for x in leaves], [x.shape for x in leaves])
        return jax.tree.unflatten(g.treedef, [got[i] for i in range(3)])

    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(lay.specs("fsdp"),), out_specs=P(), check_vma=False))(
        placed
    )
    chex.assert_trees_all_equal(out, params["g"])


@pytest.mark.parametrize("lead", [(), (3,)])
def test_split_flat_gradient_matches_slicing_and_is_one_concatenation(lead):
    from qsdp_jax._src.layout.packing import split_flat

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
        ParamLayout.create([1, 2], 8, 16, 0)
    with pytest.raises(ValueError, match=r"stacked groups \['nope'\]"):
        ParamLayout.create(_params(), 8, 16, 0, stacked=("nope",))
    bad = {"blocks": {"a": jnp.ones((3, 4)), "b": jnp.ones((2, 4))}}
    with pytest.raises(ValueError, match="same leading layer axis"):
        ParamLayout.create(bad, 8, 16, 0, stacked=("blocks",))
    lay = ParamLayout.create({"g": {"w": jnp.ones((8, 8))}}, 8, 16, 64)
    with pytest.raises(KeyError, match="unknown parameter group"):
        lay.group("nope")


def test_layout_table_names_each_leaf_and_its_split():
    with pytest.warns(UserWarning):
        lay = ParamLayout.create(_params(), 8, 16, 64, stacked=("blocks",))
    t = lay.table()
    assert "mixed/w" in t and "dim 0" in t and "replicated" in t
