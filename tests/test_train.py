"""The sharded train step against its references: DESIGN.md invariants 1, 2, 4, 5, 6."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsdp_jax as q
import toymodel
from qsdp_jax import comm, optim
from qsdp_jax.collectives import payload_size

N = 8
BUCKET = 64
SMALL = dict(bucket_size=BUCKET, min_shard_size=128)  # biases and scales stay replicated


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def _setup(mesh, config, lr=1e-2, params=None, **kw):
    opt = optim.qsdp(optax.adam(lr), config)
    params = toymodel.init(0) if params is None else params
    state = q.init_train_state(params, opt, mesh, config, stacked=toymodel.STACKED)
    step = q.make_train_step(kw.pop("loss", toymodel.loss), opt, mesh, config, **kw)
    return state, step, opt


def test_off_means_off(mesh):
    """Invariant 1: no quantization -> the sharded step matches one device on the global batch."""
    cfg = q.QSDPConfig.fp32(**SMALL)
    state, step, _ = _setup(mesh, cfg)
    params = toymodel.init(0)
    ref_opt = optax.adam(1e-2)
    ref_state = ref_opt.init(params)
    for i in range(4):
        b = toymodel.batch(i)
        state, metrics = step(state, b)
        ref_loss, g = jax.value_and_grad(lambda p: toymodel.loss(q.LocalParams(p), b))(params)  # noqa: B023  (run in this iteration)
        u, ref_state = ref_opt.update(g, ref_state, params)
        params = optax.apply_updates(params, u)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5)
        assert int(metrics["step"]) == i and int(metrics["nonfinite"]) == 0
    chex.assert_trees_all_close(q.gather_params(state), params, rtol=1e-5, atol=1e-6)
    assert int(state.step) == 4


@pytest.mark.parametrize("rounding", ["shift", "stochastic"])
def test_qsdp_gather_is_lossless_on_every_device(mesh, rounding):
    """Invariant 2: every device computes with exactly the weights the optimizer holds."""
    cfg = q.QSDPConfig.qsdp(4, 4, weight_rounding=rounding, **SMALL)
    state, step, _ = _setup(mesh, cfg, loss=toymodel.loss_with_weights, has_aux=True, donate=False)
    for i in range(3):
        held = q.gather_params(state)
        new_state, metrics, aux = step(state, toymodel.batch(i))
        for dev in range(N):
            for name, got in (("embed", aux["embed"][dev]), ("head", aux["head"][dev])):
                np.testing.assert_array_equal(
                    np.asarray(got).view(np.uint32), np.asarray(held[name]["w"]).view(np.uint32)
                )
            np.testing.assert_array_equal(
                np.asarray(aux["blocks"][dev]).view(np.uint32), np.asarray(held["blocks"]["w"]).view(np.uint32)
            )
        # and the weights really are 4-bit: at most 16 values per bucket
        flat = np.asarray(new_state.params["blocks"]["w"])[0].reshape(-1)[:BUCKET]  # one bucket
        assert len(np.unique(flat)) <= 16
        state = new_state


def test_comm_mode_is_not_lossless(mesh):
    """The check above can fail: ZeRO++-style weights differ from the master copy."""
    cfg = q.QSDPConfig(weight_mode="comm", weight_bits=4, grad_bits=4, **SMALL)
    state, step, _ = _setup(mesh, cfg, loss=toymodel.loss_with_weights, has_aux=True, donate=False)
    held = q.gather_params(state)
    _, _, aux = step(state, toymodel.batch(0))
    assert not np.array_equal(np.asarray(aux["embed"][0]), np.asarray(held["embed"]["w"]))
    err = np.abs(np.asarray(aux["embed"][0]) - np.asarray(held["embed"]["w"])).max()
    assert 0 < err < 0.1


def _wire(report, kind, dtype):
    return report.by_kind_dtype().get((kind, dtype), 0.0)


def test_wire_bytes_match_the_formula(mesh):
    """Invariant 4: collectives carry packed u8, and their bytes equal n*bits/8 + scales."""
    for wb, gb in ((8, 8), (4, 4), (2, 8)):
        cfg = q.QSDPConfig.qsdp(wb, gb, **SMALL)
        state, step, _ = _setup(mesh, cfg)
        report = comm.comm_report(step, state, toymodel.batch(0))
        lay = state.layout
        expect_ag = expect_a2a = 0.0
        for g in lay.groups:
            if not g.is_sharded:
                continue
            gathers, scatters = (2 * g.n_layers, g.n_layers) if g.stacked else (1, 1)
            (buf,) = g.buffers
            expect_ag += gathers * (N - 1) * payload_size(buf.chunk, wb, BUCKET)
            expect_a2a += scatters * (N - 1) * payload_size(buf.chunk, gb, BUCKET)
        got_ag, got_a2a = _wire(report, "all-gather", "u8"), _wire(report, "all-to-all", "u8")
        assert abs(got_ag - expect_ag) <= 0.01 * expect_ag, (wb, got_ag, expect_ag)
        assert abs(got_a2a - expect_a2a) <= 0.01 * expect_a2a, (gb, got_a2a, expect_a2a)
        # nothing big travels in f32: only the replicated small leaves' all-reduce and scalars
        f32 = sum(v for (k, d), v in report.by_kind_dtype().items() if d == "f32")
        assert f32 < 0.1 * (got_ag + got_a2a)
        assert _wire(report, "all-gather", "f32") == 0 and _wire(report, "reduce-scatter", "f32") == 0


def test_layers_are_gathered_one_at_a_time(mesh):
    """The per-layer gather runs inside the scan: L forward + L backward gathers of one layer."""
    cfg = q.QSDPConfig.qsdp(8, 8, **SMALL)
    state, step, _ = _setup(mesh, cfg)
    report = comm.comm_report(step, state, toymodel.batch(0))
    one_layer = N * payload_size(state.layout.group("blocks").buffers[0].chunk, 8, BUCKET)
    in_loops = [c for c in report.collectives if c.kind == "all-gather" and c.count == toymodel.L]
    assert len(in_loops) == 2  # forward loop and rematerialising backward loop
    assert all(c.payload_bytes == one_layer for c in in_loops)


def test_fp32_baseline_reduce_scatters(mesh):
    """The fp32 baseline is honest FSDP: f32 all-gather and reduce-scatter, no all-reduce of
    the sharded gradients."""
    cfg = q.QSDPConfig.fp32(**SMALL)
    state, step, _ = _setup(mesh, cfg)
    report = comm.comm_report(step, state, toymodel.batch(0))
    kinds = report.by_kind_dtype()
    assert kinds[("all-gather", "f32")] > 0 and kinds[("reduce-scatter", "f32")] > 0
    assert kinds.get(("all-reduce", "f32"), 0) < 0.1 * kinds[("reduce-scatter", "f32")]
    bf = q.QSDPConfig.bf16(**SMALL)
    state, step, _ = _setup(mesh, bf)
    kinds = comm.comm_report(step, state, toymodel.batch(0)).by_kind_dtype()
    assert kinds[("all-gather", "u16")] > 0 and kinds.get(("all-gather", "f32"), 0) == 0


def _host_copy(state, mesh):
    """Round-trip through host memory, as a checkpoint would."""
    host = jax.device_get(state)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.tree.map(lambda h, s: jax.device_put(h, s), host, shardings)


def test_runs_are_reproducible_and_resume_bit_for_bit(mesh):
    """Invariant 5: keys come from (seed, step, ...) only."""
    cfg = q.QSDPConfig.qsdp(4, 4, **SMALL)

    def run(steps, state=None, start=0):
        st, step, _ = _setup(mesh, cfg, donate=False)
        st = st if state is None else state
        for i in range(start, start + steps):
            st, _ = step(st, toymodel.batch(i))
        return st

    a = run(4)
    b = run(4)
    chex.assert_trees_all_equal(a.params, b.params)
    half = _host_copy(run(2), mesh)
    resumed = run(2, state=half, start=2)
    chex.assert_trees_all_equal(resumed.params, a.params)
    chex.assert_trees_all_equal(resumed.opt_state, a.opt_state)
    # a different seed gives different weights (the check can fail)
    other = q.QSDPConfig.qsdp(4, 4, seed=1, **SMALL)
    st, step, _ = _setup(mesh, other, donate=False)
    for i in range(4):
        st, _ = step(st, toymodel.batch(i))
    assert not np.array_equal(np.asarray(st.params["blocks"]["w"]), np.asarray(a.params["blocks"]["w"]))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_step_is_skipped_and_reported(mesh, bad):
    """Invariant 6: a NaN/Inf gradient on one device leaves weights and optimizer state as they
    were, on every device, and metrics say so."""
    cfg = q.QSDPConfig.qsdp(8, 8, **SMALL)
    state, step, _ = _setup(mesh, cfg, donate=False)
    state, _ = step(state, toymodel.batch(0))
    b = toymodel.batch(1)
    b["x"] = b["x"].at[5, 3].set(bad)  # only device 1 sees it
    new, metrics = step(state, b)
    assert int(metrics["nonfinite"]) == 1
    chex.assert_trees_all_equal(new.params, state.params)
    chex.assert_trees_all_equal(new.opt_state, state.opt_state)
    assert int(new.step) == int(state.step) + 1
    after, metrics = step(new, toymodel.batch(2))
    assert int(metrics["nonfinite"]) == 0
    assert not np.array_equal(np.asarray(after.params["blocks"]["w"]), np.asarray(new.params["blocks"]["w"]))


def test_eval_step_sees_training_weights(mesh):
    cfg = q.QSDPConfig.qsdp(8, 8, **SMALL)
    state, step, _ = _setup(mesh, cfg, donate=False)
    ev = q.make_eval_step(toymodel.loss, mesh, cfg)
    b = toymodel.batch(3)
    ref = toymodel.loss(q.LocalParams(q.gather_params(state)), b)
    np.testing.assert_allclose(float(ev(state, b)), float(ref), rtol=1e-5)
    _, metrics = step(state, b)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref), rtol=1e-5)


def test_training_reduces_loss_in_every_mode(mesh):
    b = toymodel.batch(0)
    for cfg in (
        q.QSDPConfig.fp32(**SMALL),
        q.QSDPConfig.bf16(**SMALL),
        q.QSDPConfig.qsdp(8, 8, **SMALL),
        q.QSDPConfig(weight_mode="comm", weight_bits=4, grad_bits=4, **SMALL),
    ):
        state, step, _ = _setup(mesh, cfg)
        first = None
        for _ in range(15):
            state, m = step(state, b)
            first = float(m["loss"]) if first is None else first
        assert float(m["loss"]) < 0.7 * first, cfg.name


def test_bad_inputs(mesh):
    cfg = q.QSDPConfig.qsdp(8, 8, **SMALL)
    state, step, opt = _setup(mesh, cfg, donate=False)
    with pytest.raises(ValueError, match="global batch of 12 examples does not divide over 8 devices"):
        step(state, toymodel.batch(0, n=12))
    with pytest.raises(ValueError, match="no axis 'fsdp'"):
        q.make_train_step(toymodel.loss, opt, q.make_mesh("data"), cfg)
    with pytest.raises(ValueError, match="no axis 'fsdp'"):
        q.init_train_state(toymodel.init(0), opt, q.make_mesh("data"), cfg)
    with pytest.raises(ValueError, match="wrapped with qsdp_jax.optim.qsdp"):
        q.init_train_state(toymodel.init(0), optax.adam(1e-2), mesh, cfg, stacked=("blocks",))
    other = q.QSDPConfig.qsdp(4, 8, **SMALL)
    with pytest.raises(ValueError, match=r"built with QSDPConfig\.weight_bits=8"):
        q.make_train_step(toymodel.loss, opt, mesh, other)(state, toymodel.batch(0))
    with pytest.raises(TypeError, match="QSDPConfig"):
        q.make_train_step(toymodel.loss, opt, mesh, {"weight_bits": 8})
    with pytest.raises(ValueError, match="layer-stacked: read it with scan"):
        q.make_train_step(lambda p, b: p.gather("blocks")["w"].sum(), opt, mesh, cfg)(state, toymodel.batch(0))


def test_works_on_a_submesh_and_odd_shapes():
    """A 7x13 matrix on 8 devices, and the same code on 2 devices."""
    params = {"m": {"w": jnp.asarray(np.random.default_rng(0).normal(size=(7, 13)), jnp.float32)}}

    def loss(p, b):
        return jnp.mean((b["x"] @ p.gather("m")["w"] - b["y"]) ** 2)

    b = {"x": jnp.ones((8, 7)), "y": jnp.zeros((8, 13))}
    for devices in (jax.devices(), jax.devices()[:2]):
        mesh = q.make_mesh(devices=devices)
        cfg = q.QSDPConfig.qsdp(8, 8, bucket_size=8, min_shard_size=16)
        opt = optim.qsdp(optax.sgd(0.05), cfg)
        state = q.init_train_state(params, opt, mesh, cfg)
        step = q.make_train_step(loss, opt, mesh, cfg)
        first = None
        for _ in range(10):
            state, m = step(state, b)
            first = float(m["loss"]) if first is None else first
        assert float(m["loss"]) < 0.5 * first
        assert q.gather_params(state)["m"]["w"].shape == (7, 13)


def test_abstract_state_compiles_like_the_real_one(mesh):
    cfg = q.QSDPConfig.qsdp(8, 8, **SMALL)
    state, step, opt = _setup(mesh, cfg)
    shapes = jax.eval_shape(lambda: toymodel.init(0))
    abstract = q.abstract_train_state(shapes, opt, mesh, cfg, stacked=toymodel.STACKED)
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract, state)
    real = comm.comm_report(step, state, toymodel.batch(0)).total_bytes
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), toymodel.batch(0))
    assert comm.comm_report(step.lower(abstract, batch).compile()).total_bytes == real
