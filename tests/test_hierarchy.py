"""Two-level meshes: the two-stage collectives and the train step on (node, local) and
(replica, fsdp) meshes of 8 simulated devices (DESIGN.md invariants 1-6 on 2-D meshes)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import qsdp_jax as q
from qsdp_jax._src.quant import quantizers as qz
import toymodel
from qsdp_jax._src.collective import hierarchy as hi
from qsdp_jax import comm, optim
from qsdp_jax.collectives import payload_size

BUCKET = 64
SMALL = dict(bucket_size=BUCKET, min_shard_size=128)
NODES, LOCAL = 2, 4


@pytest.fixture(scope="module")
def hmesh():
    return q.make_mesh({"node": NODES, "local": LOCAL})


@pytest.fixture(scope="module")
def ymesh():
    return q.make_mesh({"replica": NODES, "fsdp": LOCAL})


def hier(factory=q.QSDPConfig.qsdp, *a, **kw):
    return factory(*a, axis_name="local", node_axis="node", **SMALL, **kw)


def hybrid(factory=q.QSDPConfig.qsdp, *a, **kw):
    return factory(*a, replica_axis="replica", **SMALL, **kw)


def _smap(mesh, f, in_spec, out_spec):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False))


def _setup(mesh, config, **kw):
    opt = optim.qsdp(optax.adam(1e-2), config)
    state = q.init_train_state(toymodel.init(0), opt, mesh, config, stacked=toymodel.STACKED)
    step = q.make_train_step(kw.pop("loss", toymodel.loss), opt, mesh, config, **kw)
    return state, step


# ----------------------------------------------------------------------------------------------
# The collectives on their own
# ----------------------------------------------------------------------------------------------
def test_mesh_is_hosts_outermost_and_errors():
    mesh = q.make_mesh({"node": 2, "local": 4})
    assert mesh.axis_names == ("node", "local") and mesh.shape == {"node": 2, "local": 4}
    assert [d.id for d in mesh.devices[1]] == [4, 5, 6, 7]
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    with pytest.raises(ValueError, match=r"3 x 4 = 12 devices, but there are 8"):
        q.make_mesh({"node": 3, "local": 4})
    with pytest.raises(ValueError, match="size 0"):
        q.make_mesh({"node": 0, "local": 4})


def test_config_errors(hmesh, ymesh):
    with pytest.raises(ValueError, match=r"inter_grad_bits=4 is invalid: must be None on a 1-D mesh"):
        q.QSDPConfig.qsdp(8, 8, inter_grad_bits=4)
    with pytest.raises(ValueError, match=r"inter_weight_bits=4 .*lossless"):
        hier(q.QSDPConfig.qsdp, 8, 8, inter_weight_bits=4)
    with pytest.raises(ValueError, match="node_axis='fsdp' is invalid"):
        q.QSDPConfig(node_axis="fsdp")
    opt = optim.qsdp(optax.adam(1e-2), q.QSDPConfig.qsdp(8, 8, **SMALL))
    one_d = q.QSDPConfig.qsdp(8, 8, **SMALL)
    with pytest.raises(ValueError, match=r"mesh axis 'replica' is not known to the config.*replica_axis='replica'"):
        q.make_train_step(toymodel.loss, opt, ymesh, one_d)
    with pytest.raises(ValueError, match="no axis 'fsdp'"):
        q.init_train_state(toymodel.init(0), opt, hmesh, one_d, stacked=toymodel.STACKED)
    swapped = q.QSDPConfig.qsdp(8, 8, axis_name="node", node_axis="local", **SMALL)
    with pytest.raises(ValueError, match="wrong order"):
        q.make_train_step(toymodel.loss, opt, hmesh, swapped)


def test_two_level_fp_collectives_equal_flat_ones(hmesh):
    """fp32 two-stage gather / reduce-scatter == one flat collective over both axes."""
    axes = ("node", "local")
    c = 2 * BUCKET
    x = jax.random.normal(jax.random.PRNGKey(0), (8 * c,))
    kw = dict(outer_axis="node", inner_axis="local", bucket=BUCKET, outer_bits=None, inner_bits=None)
    got = _smap(hmesh, lambda s: hi.two_level_all_gather(s, weight_mode="full", **kw), P(axes), P())(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
    full = jax.random.normal(jax.random.PRNGKey(1), (8, 8 * c))
    rs = _smap(hmesh, lambda f: hi.two_level_reduce_scatter(f[0], key=None, **kw), P(axes), P(axes))(full)
    np.testing.assert_allclose(np.asarray(rs), np.asarray(full.sum(0)), rtol=1e-5, atol=1e-5)


def test_two_level_gather_on_grid_is_lossless(hmesh):
    axes = ("node", "local")
    x = jax.random.normal(jax.random.PRNGKey(2), (8 * BUCKET * 2,))
    qt = qz.quantize(x, 4, BUCKET, "nearest")
    on_grid = qt.dequantize()

    def g(s, sc, off):
        return hi.two_level_all_gather(
            s,
            outer_axis="node",
            inner_axis="local",
            bucket=BUCKET,
            weight_mode="qsdp",
            outer_bits=4,
            inner_bits=4,
            grid=(sc, off),
        )

    got = _smap(hmesh, g, (P(axes), P(axes), P(axes)), P())(on_grid, qt.scales, qt.offsets)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(on_grid).view(np.uint32))


@pytest.mark.parametrize("hybrid_mesh", [False, True])
def test_two_level_quantized_reduction_is_unbiased(hmesh, ymesh, hybrid_mesh):
    """Invariant 3 on two levels: the mean over keys converges to the exact sum."""
    spec = hi.TwoLevelSpec(
        outer_axis="replica" if hybrid_mesh else "node",
        inner_axis="fsdp" if hybrid_mesh else "local",
        hybrid=hybrid_mesh,
        bucket=BUCKET,
        weight_mode="full",
        inner_weight_bits=None,
        outer_weight_bits=None,
        inner_grad_bits=3,
        outer_grad_bits=2,
    )
    mesh = ymesh if hybrid_mesh else hmesh
    shards = LOCAL if hybrid_mesh else 8
    full = jax.random.normal(jax.random.PRNGKey(3), (8, shards * BUCKET))
    spec_in = P(mesh.axis_names)

    def rs(f, k):
        return spec.reduce_scatter(f[0], k[0])[None]

    fn = _smap(mesh, rs, (spec_in, P()), P(mesh.axis_names))
    exact = np.asarray(full.sum(0))
    keys = 64
    draws = np.stack([np.asarray(fn(full, jnp.full((1,), k, jnp.uint32))) for k in range(keys)])
    if hybrid_mesh:  # every replica holds the same bits; device (r, f) holds chunk f
        np.testing.assert_array_equal(draws[:, :LOCAL], draws[:, LOCAL:])
        draws = draws[:, :LOCAL]
    draws = draws.reshape(keys, -1)
    one_err = np.abs(draws[0] - exact).mean()
    mean_err = np.abs(draws.mean(0) - exact).mean()
    assert one_err > 0.05  # 2-bit across: really quantized
    assert mean_err < 2.5 * one_err / np.sqrt(keys), (mean_err, one_err)


# ----------------------------------------------------------------------------------------------
# The train step on 2-D meshes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hier", "hybrid"])
def test_off_means_off_on_2d_mesh(hmesh, ymesh, kind):
    """Invariant 1: fp32 two-level step == one device on the global batch."""
    mesh, cfg = (hmesh, hier(q.QSDPConfig.fp32)) if kind == "hier" else (ymesh, hybrid(q.QSDPConfig.fp32))
    state, step = _setup(mesh, cfg)
    params = toymodel.init(0)
    ref_opt = optax.adam(1e-2)
    ref_state = ref_opt.init(params)
    for i in range(3):
        b = toymodel.batch(i)
        state, metrics = step(state, b)
        ref_loss, g = jax.value_and_grad(lambda p: toymodel.loss(q.LocalParams(p), b))(params)  # noqa: B023  (run in this iteration)
        u, ref_state = ref_opt.update(g, ref_state, params)
        params = optax.apply_updates(params, u)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5)
    chex.assert_trees_all_close(q.gather_params(state), params, rtol=1e-5, atol=1e-6)


def _compiled_qsdp_run(mesh, cfg, steps=2):
    """One compile of the QSDP step (8-bit weights and gradients inside, 4-bit gradients
    across) with the weights every device computed with as aux; a few steps of it."""
    state, step = _setup(mesh, cfg, loss=toymodel.loss_with_weights, has_aux=True, donate=False)
    compiled = step.lower(state, toymodel.batch(0)).compile()
    history = []
    for i in range(steps):
        held = q.gather_params(state)
        new, metrics, aux = compiled(state, toymodel.batch(i))
        history.append((held, metrics, aux))
        state = new
    return dict(state=state, compiled=compiled, history=history, first=history[0])


@pytest.fixture(scope="module")
def hier_run(hmesh):
    return _compiled_qsdp_run(hmesh, hier(q.QSDPConfig.qsdp, 8, 8, inter_grad_bits=4))


@pytest.fixture(scope="module")
def hybrid_run(ymesh):
    return _compiled_qsdp_run(ymesh, hybrid(q.QSDPConfig.qsdp, 8, 8, inter_grad_bits=4), steps=3)


@pytest.mark.parametrize("kind", ["hier", "hybrid"])
def test_qsdp_gather_lossless_on_every_device_2d(hier_run, hybrid_run, kind):
    """Invariant 2 on 2-D meshes, with 4-bit gradients across the outer level."""
    run = hier_run if kind == "hier" else hybrid_run
    for held, metrics, aux in run["history"]:
        assert int(metrics["nonfinite"]) == 0
        for dev in range(8):
            for name in ("embed", "head", "blocks"):
                np.testing.assert_array_equal(
                    np.asarray(aux[name][dev]).view(np.uint32),
                    np.asarray(held[name]["w"]).view(np.uint32),
                    err_msg=f"{name} dev {dev}",
                )
    assert float(run["history"][-1][1]["loss"]) < float(run["first"][1]["loss"])


def test_hybrid_replicas_hold_identical_state(ymesh, hybrid_run):
    """Weights and optimizer state are bit-identical on the two replicas of every shard."""
    state = hybrid_run["state"]
    leaves = jax.tree.leaves((state.params, state.opt_state))
    mesh_pos = {d.id: pos for pos, d in np.ndenumerate(ymesh.devices)}
    checked = 0
    for x in leaves:
        if x.size == 0:
            continue
        by_shard = {}  # fsdp position -> [data on replica 0, data on replica 1]
        for s in x.addressable_shards:
            by_shard.setdefault(mesh_pos[s.device.id][1], []).append(np.asarray(s.data))
        assert sorted(by_shard) == list(range(LOCAL)) and all(len(v) == NODES for v in by_shard.values())
        for a, b in by_shard.values():
            np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
        checked += 1
    assert checked >= 6  # 3 weight buffers, Adam's moments, the grids


def test_nonfinite_step_is_skipped_2d(hier_run):
    """Invariant 6 on a hierarchical mesh."""
    state, compiled = hier_run["state"], hier_run["compiled"]
    b = toymodel.batch(0)
    bad = {"x": b["x"].at[5, 0].set(jnp.nan), "y": b["y"]}
    new, m, _ = compiled(state, bad)
    assert int(m["nonfinite"]) == 1
    chex.assert_trees_all_equal(q.gather_params(new), q.gather_params(state))


# ----------------------------------------------------------------------------------------------
# Per-level bits in the compiled step
# ----------------------------------------------------------------------------------------------
def _u8_collectives_by_axis(compiled):
    """{(kind, axis): {u8 bytes of one op}} where axis is 'node' (groups {l, 4 + l}) or
    'local' (groups {4n .. 4n + 3}) of the (2, 4) device grid, from ``qsdp_jax.comm``'s report
    of the compiled step (its replica groups, in whichever form XLA prints them)."""
    out = {}
    for c in comm.comm_report(compiled).collectives:
        if c.dtype != "u8" or c.kind not in ("all-gather", "all-to-all"):
            continue
        axes = comm.axes_spanned(c.replica_groups, {"node": NODES, "local": LOCAL})
        out.setdefault((c.kind, axes[0] if len(axes) == 1 else "both"), set()).add(c.payload_bytes)
    return out


def test_per_level_bits_visible_in_compiled_step(hier_run):
    """8-bit gradients inside the node, 4-bit across; 8-bit weight codes forwarded on both."""
    got = _u8_collectives_by_axis(hier_run["compiled"])
    assert "both" not in {a for _, a in got}
    chunk = hier_run["state"].layout.group("blocks").chunk  # per device, one layer
    # gradients: inside the node L chunks of the node's N * chunk partial sums, 8 bits ...
    a2a_local, a2a_node = got[("all-to-all", "local")], got[("all-to-all", "node")]
    assert LOCAL * payload_size(NODES * chunk, 8, BUCKET) in a2a_local, a2a_local
    # ... across nodes N chunks, 4 bits
    assert NODES * payload_size(chunk, 4, BUCKET) in a2a_node, a2a_node
    assert all(v < LOCAL * payload_size(NODES * chunk, 8, BUCKET) / 3 for v in a2a_node)
    # weights: the 8-bit payload of one chunk gathered across nodes, then N of them inside
    ag_node, ag_local = got[("all-gather", "node")], got[("all-gather", "local")]
    assert NODES * payload_size(chunk, 8, BUCKET) in ag_node, ag_node
    assert LOCAL * NODES * payload_size(chunk, 8, BUCKET) in ag_local, ag_local


def test_bytes_per_axis_match_the_formula(hmesh, hier_run):
    """Invariant 4 on both levels: the u8 wire bytes on each mesh axis equal the formula
    (payload of n codes of b bits plus 8 bytes per bucket) within 1%."""
    from experiments.shelf.twolevel_workload import bytes_by_axis

    got = bytes_by_axis(hier_run["compiled"], hmesh, detail=True)
    expect = {
        "node/all-gather/u8": 0.0,
        "local/all-gather/u8": 0.0,
        "local/all-to-all/u8": 0.0,
        "node/all-to-all/u8": 0.0,
    }
    for g in hier_run["state"].layout.groups:
        if not g.is_sharded:
            continue
        gathers, scatters = (2 * g.n_layers, g.n_layers) if g.stacked else (1, 1)
        c = g.chunk
        expect["node/all-gather/u8"] += gathers * (NODES - 1) * payload_size(c, 8, BUCKET)
        expect["local/all-gather/u8"] += gathers * (LOCAL - 1) * NODES * payload_size(c, 8, BUCKET)
        expect["local/all-to-all/u8"] += scatters * (LOCAL - 1) * payload_size(NODES * c, 8, BUCKET)
        expect["node/all-to-all/u8"] += scatters * (NODES - 1) * payload_size(c, 4, BUCKET)
    for k, v in expect.items():
        assert abs(got.get(k, 0.0) - v) <= 0.01 * v, (k, got.get(k), v)
    assert not [k for k in got if k.endswith("/u8") and k not in expect], got


def test_hybrid_cross_group_reduction_is_quantized_in_compiled_step(hybrid_run):
    """Hybrid: 8-bit gather and reduce-scatter inside the group; across groups the gradient
    shard travels as 4-bit codes twice (all_to_all, then the all-gather of the sums)."""
    got = _u8_collectives_by_axis(hybrid_run["compiled"])  # node = replica, local = fsdp
    assert "both" not in {a for _, a in got}
    chunk = hybrid_run["state"].layout.group("blocks").chunk
    half = -(-chunk // (NODES * BUCKET)) * BUCKET  # each replica sums 1/R of the padded shard
    assert LOCAL * payload_size(chunk, 8, BUCKET) in got[("all-to-all", "local")]
    assert LOCAL * payload_size(chunk, 8, BUCKET) in got[("all-gather", "local")]
    assert NODES * payload_size(half, 4, BUCKET) in got[("all-to-all", "node")]
    assert NODES * payload_size(half, 4, BUCKET) in got[("all-gather", "node")]
