"""QSDPConfig.weight_grid="sticky": a bucket keeps its weight grid while its values fit it."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsdp_jax as q
import toymodel
from qsdp_jax import optim
from qsdp_jax import quantizers as qz
from qsdp_jax import sticky_grid as sg
from qsdp_jax.checkpoint import Checkpointer

BUCKET = 256
SMALL = dict(bucket_size=64, min_shard_size=128)


def _on_grid(bits, seed, rows=4, n=4 * BUCKET, stats="float32"):
    x = jax.random.normal(jax.random.PRNGKey(seed), (rows, n))
    return qz.quantize(x, bits, BUCKET, "stochastic", qz.derive_key(seed, 7), stats_dtype=stats)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("stats", ["float32", "bfloat16"])
def test_a_grid_that_never_fits_without_headroom_gives_quantize_bit_for_bit(bits, stats):
    x = jax.random.normal(jax.random.PRNGKey(bits), (3, 4 * BUCKET)) * 3.0
    key, ids = qz.derive_key(5, bits), jnp.arange(12, dtype=jnp.uint32).reshape(3, 4) + 100
    want = qz.quantize(x, bits, BUCKET, "stochastic", key, bucket_ids=ids, stats_dtype=stats)
    tiny = jnp.full(want.scales.shape, 1e-9, jnp.float32)
    got = sg.quantize_sticky(x, bits, BUCKET, key, tiny, tiny, bucket_ids=ids, stats_dtype=stats, headroom=0.0)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # with headroom: the grid covers the range widened by HEADROOM on each side, and no more
    wide = sg.quantize_sticky(x, bits, BUCKET, key, tiny, tiny, bucket_ids=ids, stats_dtype=stats)
    lo, hi = (np.asarray(a) for a in qz.bucket_range(qz.to_buckets(x, BUCKET)))
    pad, top = (hi - lo) * sg.HEADROOM, qz.levels(bits)
    off, sc = np.asarray(wide.offsets), np.asarray(wide.scales)
    assert np.all(off <= lo - pad * (1 - 1e-5)) and np.all(off + top * sc >= hi + pad * (1 - 1e-5))
    assert np.all(sc <= (hi - lo + 2 * pad) / top * (1 + 2**-6))  # bf16 stats round up by < 2**-7
    assert np.all(np.asarray(wide.codes) <= top)
    with pytest.raises(ValueError, match="headroom=1.0"):
        sg.quantize_sticky(x, bits, BUCKET, key, tiny, tiny, headroom=1.0)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_weights_that_did_not_move_stay_exactly_and_keep_their_grid(bits):
    qt = _on_grid(bits, bits)
    w = qt.dequantize()
    for k in range(3):
        got = sg.quantize_sticky(w, bits, BUCKET, qz.derive_key(9, k), qt.scales, qt.offsets)
        np.testing.assert_array_equal(np.asarray(got.dequantize()), np.asarray(w))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(qt.scales))
    # a fresh grid re-rounds them: the thing the sticky grid removes
    fresh = qz.quantize(w * 1.001, bits, BUCKET, "stochastic", qz.derive_key(9, 0))
    assert not np.array_equal(np.asarray(fresh.dequantize()), np.asarray(w * 1.001))


def test_kept_buckets_refits_on_leaving_shrinking_nan_and_constant():
    s, o = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0]), jnp.array([0.0, 0.0, 0.0, 0.0, 2.0, 2.0])
    lo = jnp.array([0.0, -0.1, 3.0, jnp.nan, 2.0, 2.0])
    hi = jnp.array([15.0, 10.0, 10.0, 5.0, 2.0, 2.5])
    # fits | leaves below | spans 7 of 15 steps < MIN_FILL | NaN | constant kept | constant left
    assert sg.kept_buckets(lo, hi, s, o, 4).tolist() == [True, False, False, False, True, False]
    assert sg.kept_buckets(jnp.array([0.0]), jnp.array([15.0 * (1 + 2**-20)]), s[:1], o[:1], 4).tolist() == [True]
    assert sg.kept_buckets(jnp.array([0.0]), jnp.array([15.01]), s[:1], o[:1], 4).tolist() == [False]


def test_unbiased_and_far_less_noise_than_a_fresh_grid_for_small_updates():
    """Small updates (0.05 step) that also move each bucket's extremes: both roundings are
    unbiased, but the fresh grid re-rounds every weight, the sticky one only moves the updated
    ones with probability |u|/step (its grid has headroom, so the extremes stay inside it)."""
    bits, draws = 4, 2000
    x0 = jax.random.normal(jax.random.PRNGKey(0), (1, BUCKET))
    tiny = jnp.full((1, 1), 1e-9)
    qt = sg.quantize_sticky(x0, bits, BUCKET, qz.derive_key(0, 7), tiny, tiny)  # a refit: headroom
    w = qt.dequantize()
    u = 0.05 * qt.scales[..., None] * jax.random.choice(jax.random.PRNGKey(1), jnp.array([-1.0, 1.0]), (1, 1, BUCKET))
    x = w + u.reshape(w.shape)
    keys = jnp.arange(draws, dtype=jnp.uint32)
    sticky = jax.vmap(lambda k: sg.quantize_sticky(x, bits, BUCKET, k, qt.scales, qt.offsets).dequantize())(keys)
    fresh = jax.vmap(lambda k: qz.quantize(x, bits, BUCKET, "stochastic", k).dequantize())(keys)
    step = float(qt.scales[0, 0])
    for out in (sticky, fresh):
        err = np.asarray(out - x[None])
        sem = err.std(0) / np.sqrt(draws)
        # quantize rounds scales up to 16 significant bits: the top code lies up to
        # 15 * 2**-16 steps above the bucket's max, which the max itself rounds onto
        rounding = 16 * 2.0**-16 * step
        assert np.all(np.abs(err.mean(0)) < 6 * sem + rounding)  # unbiased per element
    mse = lambda out: float(np.mean(np.asarray(out - x[None]) ** 2))  # noqa: E731
    # sticky: each weight moves one step w.p. 0.05: var = 0.05 * 0.95 step^2
    assert mse(sticky) == pytest.approx(0.0475 * step**2, rel=0.1)
    assert mse(sticky) < mse(fresh) / 2


@pytest.mark.parametrize("kw, match", [
    (dict(weight_grid="stale"), "one of 'fresh', 'sticky'"),
    (dict(weight_grid="sticky", weight_rounding="shift"), "weight_rounding='shift'"),
    (dict(weight_grid="sticky", weight_mode="comm"), "weight_mode='comm'"),
])
def test_config_refuses_sticky_without_a_kept_grid(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        q.QSDPConfig(**kw)
    assert "QSDPConfig.weight_grid" in str(e.value)


def test_name_and_trainer_flag():
    from experiments import train_args

    assert q.QSDPConfig.qsdp(4, 4, weight_grid="sticky").name == "qsdp-sr-W4G4-sticky"
    on = train_args.qsdp_kwargs(train_args.parse_args(["--weight-grid", "sticky"]))
    assert q.QSDPConfig(**on).weight_grid == "sticky"
    assert "weight_grid" not in train_args.qsdp_kwargs(train_args.parse_args([]))


def _digest(tree):
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()[:16]


def _opt(config):
    return optim.qsdp(optax.chain(optim.clip_by_global_norm(1.0), optax.adam(3e-3)), config)


def _kept_fraction(before, after):
    a, b = optim.find_qsdp_state(before.opt_state), optim.find_qsdp_state(after.opt_state)
    same = [np.asarray(x) == np.asarray(y) for x, y in zip(jax.tree.leaves(a.scales), jax.tree.leaves(b.scales))]
    return sum(int(s.sum()) for s in same) / sum(s.size for s in same)


def test_training_gathers_losslessly_keeps_grids_and_resumes_exactly(tmp_path):
    cfg = q.QSDPConfig.qsdp(4, 4, weight_grid="sticky", **SMALL)
    mesh = q.make_mesh()
    step = q.make_train_step(toymodel.loss_with_weights, _opt(cfg), mesh, cfg, has_aux=True, donate=False)
    state = q.init_train_state(toymodel.init(0), _opt(cfg), mesh, cfg, stacked=toymodel.STACKED)
    losses, kept = [], []
    for i in range(4):
        held = q.gather_params(state)
        before = state
        state, m, aux = step(state, toymodel.batch(i))
        losses.append(float(m["loss"]))
        np.testing.assert_array_equal(np.asarray(aux["embed"][5]).view(np.uint32),
                                      np.asarray(held["embed"]["w"]).view(np.uint32))
        kept.append(_kept_fraction(before, state))
        if i == 1:
            half = state
    assert all(np.isfinite(losses))
    fresh_cfg = q.QSDPConfig.qsdp(4, 4, **SMALL)
    fresh = q.init_train_state(toymodel.init(0), _opt(fresh_cfg), mesh, fresh_cfg, stacked=toymodel.STACKED)
    fstep = q.make_train_step(toymodel.loss_with_weights, _opt(fresh_cfg), mesh, fresh_cfg, has_aux=True, donate=False)
    after, _, _ = fstep(fresh, toymodel.batch(0))
    # a fresh grid moves with its bucket's extremes (only constant padding buckets stay put)
    assert min(kept[1:]) > _kept_fraction(fresh, after) + 0.3, (kept, _kept_fraction(fresh, after))
    with Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(half, cfg, mesh)
        ckpt.wait()
        blank = q.init_train_state(toymodel.init(1), _opt(cfg), mesh, cfg, stacked=toymodel.STACKED)
        restored, _ = ckpt.restore(blank, cfg, mesh)
    again = []
    for i in (2, 3):
        restored, m, _ = step(restored, toymodel.batch(i))
        again.append(float(m["loss"]))
    assert again == losses[2:]
    assert _digest((restored.params, restored.opt_state)) == _digest((state.params, state.opt_state))


def test_single_device_optax_loop_stays_on_the_kept_grid():
    """``optim.qsdp`` alone (no sharded step): the sticky grid keeps weights on the grid."""
    cfg = q.QSDPConfig.qsdp(4, None, weight_grid="sticky", bucket_size=BUCKET, min_shard_size=256)
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (32, 64)) * 0.1}
    opt = _opt(cfg)
    params, state = optim.init_on_grid(params, opt, cfg)
    grad_fn = jax.grad(lambda p: jnp.sum((p["w"] - 0.05) ** 2))
    for _ in range(5):
        updates, state = opt.update(grad_fn(params), state, params)
        params = optim.apply_updates(params, updates, state, cfg)
        snapped = optim.snap_to_grid(params, state, cfg)
        np.testing.assert_array_equal(np.asarray(snapped["w"]), np.asarray(params["w"]))


@pytest.mark.parametrize("platform", ["tpu", "cuda"], ids=["to-TPU", "to-CUDA"])
def test_step_with_a_sticky_grid_exports_for_gpu_and_tpu(platform):
    """``jax.export`` lowers the sticky step (with bf16 stats) for hardware we do not have."""
    cfg = q.QSDPConfig.qsdp(4, 4, weight_grid="sticky", stats_dtype="bfloat16", **SMALL)
    mesh = q.make_mesh()
    opt = _opt(cfg)
    state = q.abstract_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
    step = q.make_train_step(toymodel.loss, opt, mesh, cfg)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), toymodel.batch(0))
    module = jax.export.export(step, platforms=[platform])(state, batch).mlir_module()
    assert '"stablehlo.all_gather"' in module and "ui8>" in module


def test_two_level_mesh_gathers_losslessly_on_every_device():
    """On a (node, local) mesh the sticky grid's weights reach all 8 devices bit for bit."""
    hmesh = q.make_mesh({"node": 2, "local": 4})
    cfg = q.QSDPConfig.qsdp(4, 4, weight_grid="sticky", axis_name="local", node_axis="node", **SMALL)
    opt = _opt(cfg)
    state = q.init_train_state(toymodel.init(0), opt, hmesh, cfg, stacked=toymodel.STACKED)
    step = q.make_train_step(toymodel.loss_with_weights, opt, hmesh, cfg, has_aux=True, donate=False)
    for i in range(3):
        held = q.gather_params(state)
        state, _, aux = step(state, toymodel.batch(i))
        for dev in range(8):
            for name in ("embed", "head", "blocks"):
                np.testing.assert_array_equal(np.asarray(aux[name][dev]).view(np.uint32),
                                              np.asarray(held[name]["w"]).view(np.uint32))
