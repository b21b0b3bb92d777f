"""Bytes per mesh axis: hand-built shard_map collectives on a ("node", "local") = 2 x 4 mesh of
the 8 simulated devices, classified by the axes their replica groups span."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from qsdp_jax.comm import CommReport, axes_spanned, comm_report

AUTO = jax.sharding.AxisType.Auto


@pytest.fixture(scope="module", params=["in order", "permuted"])
def mesh(request):
    devs = np.array(jax.devices()[:8])
    if request.param == "permuted":  # positions in the mesh, not device ids, define the axes
        devs = devs[[5, 2, 7, 0, 3, 6, 1, 4]]
    return Mesh(devs.reshape(2, 4), ("node", "local"), axis_types=(AUTO, AUTO))


def _report(mesh, f, in_spec, out_spec, x) -> CommReport:
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False))
    return comm_report(g, x)


def test_psum_over_local_is_intra_node(mesh):
    r = _report(
        mesh, lambda a: lax.psum(a, "local"), P(("node", "local")), P("node"), jnp.zeros((8 * 64,), jnp.float32)
    )
    # all-reduce of 256 B in groups of 4: 2 * 256 * 3/4
    assert r.by_axis(mesh) == {"local": 384.0}
    assert r.bytes_spanning(mesh, "node") == 0.0 and r.bytes_spanning(mesh, "local") == 384.0


def test_all_gather_over_node_is_inter_node(mesh):
    r = _report(
        mesh,
        lambda a: lax.all_gather(a, "node", tiled=True),
        P(("node", "local")),
        P("local"),
        jnp.zeros((8 * 32,), jnp.float32),
    )
    # result f32[64] = 256 B, groups of 2: 256 * 1/2
    assert r.by_axis(mesh) == {"node": 128.0}
    assert r.bytes_spanning(mesh, "node") == 128.0 and r.bytes_spanning(mesh, "local") == 0.0


def test_reduce_scatter_over_both_axes(mesh):
    r = _report(
        mesh,
        lambda a: lax.psum_scatter(a, ("node", "local"), tiled=True),
        P(),
        P(("node", "local")),
        jnp.zeros((64,), jnp.float32),
    )
    assert r.by_axis(mesh) == {"node+local": 224.0}
    assert r.bytes_spanning(mesh, "node") == r.bytes_spanning(mesh, "local") == 224.0


def test_two_stage_program_splits_by_axis(mesh):
    """A two-level reduce (scatter inside the node, then across nodes) and a u8 gather across
    nodes: the report separates intra- from inter-node bytes and by dtype."""

    def f(g, w):
        inner = lax.psum_scatter(g, "local", tiled=True)  # f32, intra-node
        outer = lax.psum_scatter(inner, "node", tiled=True)  # f32, inter-node
        codes = lax.all_gather(w, "node", tiled=True)  # u8, inter-node
        perm = lax.ppermute(w, "local", [(i, (i + 1) % 4) for i in range(4)])  # intra-node
        return outer, codes, perm

    g = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P(), P(("node", "local"))),
            out_specs=(P(("node", "local")), P("local"), P(("node", "local"))),
            check_vma=False,
        )
    )
    r = comm_report(g, jnp.zeros((512,), jnp.float32), jnp.zeros((8 * 16,), jnp.uint8))
    by = r.by_axis(mesh)
    # local: reduce-scatter 2048 B * 3/4 + ppermute 16 B; node: 512 B * 1/2 + u8 32 B * 1/2
    assert by == {"local": 1536.0 + 16.0, "node": 256.0 + 16.0}
    assert sum(by.values()) == r.total_bytes
    inter = [c for c in r.collectives if "node" in axes_spanned(c.replica_groups, mesh)]
    assert sorted((c.kind, c.dtype) for c in inter) == [("all-gather", "u8"), ("reduce-scatter", "f32")]


def test_axes_spanned_and_errors(mesh):
    sizes = {"node": 2, "local": 4}
    assert axes_spanned([(0, 1, 2, 3), (4, 5, 6, 7)], sizes) == ("local",)
    assert axes_spanned([(0, 4), (1, 5)], sizes) == ("node",)
    assert axes_spanned([(0, 5)], sizes) == ("node", "local")
    assert axes_spanned([(3,)], sizes) == ()
    with pytest.raises(ValueError, match="outside the mesh"):
        axes_spanned([(0, 8)], sizes)
    r = _report(mesh, lambda a: lax.psum(a, "local"), P(("node", "local")), P("node"), jnp.zeros((8 * 8,), jnp.float32))
    with pytest.raises(ValueError, match="has 4 devices but the program ran on 8"):
        r.by_axis({"local": 4})
    with pytest.raises(ValueError, match="'replica' is not a mesh axis"):
        r.bytes_spanning(mesh, "replica")
