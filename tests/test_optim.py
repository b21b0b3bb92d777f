"""qsdp_jax.optim on one device: grid projection, convergence vs plain adam, guards."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qsdp_jax as q
from qsdp_jax import optim
from qsdp_jax._src.quant import quantizers as qz

BUCKET = 64
CFG8 = q.QSDPConfig.qsdp(8, 8, bucket_size=BUCKET, min_shard_size=256, weight_rounding="shift")


def _on_grid(x, st_scales, st_offsets, bits):
    """x (any shape) is exactly representable on the grid (flattened, edge-padded rows)."""
    flat = jnp.asarray(x, jnp.float32).reshape(1, -1)
    flat = (
        qz.pad_last(flat, BUCKET)
        if flat.shape[-1] % BUCKET == 0
        else jnp.pad(flat, ((0, 0), (0, (-flat.shape[-1]) % BUCKET)), mode="edge")
    )
    qt = qz.quantize_on_grid(flat, st_scales, st_offsets, bits, BUCKET)
    return bool(jnp.all(qt.dequantize() == flat))


def _params(seed=0):
    r = np.random.default_rng(seed)
    return {"w": jnp.asarray(r.normal(size=(20, 30)), jnp.float32), "b": jnp.asarray(r.normal(size=(30,)), jnp.float32)}


def test_init_and_updates_land_on_the_grid():
    opt = optim.qsdp(optax.adam(1e-2), CFG8)
    params, state = optim.init_on_grid(_params(), opt, CFG8)
    st = optim.find_qsdp_state(state)
    assert st.scales["w"].shape == (1, 10)  # 600 elements -> 10 buckets of 64 (padded)
    assert st.scales["b"].size == 0  # 30 < min_shard_size: full precision
    assert _on_grid(params["w"], st.scales["w"], st.offsets["w"], 8)
    grads = jax.tree.map(lambda x: 0.1 * jnp.sin(x), params)
    updates, state = opt.update(grads, state, params)
    st = optim.find_qsdp_state(state)
    loose = optax.apply_updates(params, updates)
    exact = optim.apply_updates(params, updates, state, CFG8)
    assert _on_grid(exact["w"], st.scales["w"], st.offsets["w"], 8)
    np.testing.assert_allclose(loose["w"], exact["w"], rtol=0, atol=1e-6)  # up to float rounding
    # small leaf: a plain adam step
    plain_u, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)
    chex.assert_trees_all_close(updates["b"], plain_u["b"])
    # at most 2**bits distinct values per bucket
    rows = np.asarray(exact["w"]).reshape(-1)[: 9 * BUCKET].reshape(9, BUCKET)
    assert max(len(np.unique(r)) for r in rows) <= 256


def test_projection_changes_with_count_and_seed_only():
    p = _params()
    a = optim.qsdp(optax.sgd(0.1), CFG8)
    b = optim.qsdp(
        optax.sgd(0.1), q.QSDPConfig.qsdp(8, 8, bucket_size=BUCKET, min_shard_size=256, seed=1, weight_rounding="shift")
    )
    sa, sb = a.init(p), b.init(p)
    chex.assert_trees_all_equal(sa, a.init(p))  # pure function of (seed, count, position)
    assert not np.array_equal(optim.find_qsdp_state(sa).offsets["w"], optim.find_qsdp_state(sb).offsets["w"])
    g = jax.tree.map(jnp.ones_like, p)
    u1, s1 = a.update(g, sa, p)
    u2, s2 = a.update(g, sa, p)
    chex.assert_trees_all_equal((u1, s1), (u2, s2))
    assert int(s1.count) == 1


def test_nonfinite_gradients_leave_state_untouched():
    opt = optim.qsdp(optax.adam(1e-2), CFG8)
    params, state = optim.init_on_grid(_params(), opt, CFG8)
    for bad in (jnp.nan, jnp.inf):
        grads = jax.tree.map(jnp.ones_like, params)
        grads["b"] = grads["b"].at[3].set(bad)
        updates, new_state = opt.update(grads, state, params)
        chex.assert_trees_all_equal(new_state, state)
        assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))


def test_update_needs_params_and_config_type():
    opt = optim.qsdp(optax.adam(1e-2), CFG8)
    state = opt.init(_params())
    with pytest.raises(ValueError, match="needs params"):
        opt.update(_params(), state)
    with pytest.raises(TypeError, match="QSDPConfig"):
        optim.qsdp(optax.adam(1e-2), {"weight_bits": 8})


def test_comm_and_full_modes_do_not_project():
    for cfg in (q.QSDPConfig.fp32(), q.QSDPConfig(weight_mode="comm", weight_bits=4, grad_bits=4)):
        opt = optim.qsdp(optax.sgd(0.1), cfg)
        p = _params()
        s = opt.init(p)
        u, _ = opt.update(jax.tree.map(jnp.ones_like, p), s)  # no params needed
        chex.assert_trees_all_close(u, jax.tree.map(lambda x: -0.1 * jnp.ones_like(x), p))
        assert optim.snap_to_grid(p, s, cfg) is p


def test_found_inside_chain():
    opt = optax.chain(optax.clip_by_global_norm(1.0), optim.qsdp(optax.adam(1e-3), CFG8))
    s = opt.init(_params())
    assert isinstance(optim.find_qsdp_state(s), optim.QSDPState)
    assert optim.find_qsdp_state(optax.adam(1e-3).init(_params())) is None
    double = optax.chain(optim.qsdp(optax.sgd(1.0), CFG8), optim.qsdp(optax.sgd(1.0), CFG8))
    with pytest.raises(ValueError, match="more than one"):
        optim.find_qsdp_state(double.init(_params()))


def _classification_data():
    """Softmax regression on overlapping Gaussian classes: a convex, well-conditioned problem."""
    r = np.random.default_rng(0)
    centers = r.normal(size=(10, 64)) * 0.5
    labels = r.integers(0, 10, size=4096)
    x = centers[labels] + r.normal(size=(4096, 64))
    return jnp.asarray(x, jnp.float32), jnp.asarray(labels)


def _softmax_loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ p["w"] + p["b"], y).mean()


def _train_softmax(opt, cfg, steps=300):
    x, y = _classification_data()
    r = np.random.default_rng(10)
    p0 = {"w": jnp.asarray(r.normal(size=(64, 10)) * 0.1, jnp.float32), "b": jnp.zeros((10,), jnp.float32)}
    p, s = optim.init_on_grid(p0, opt, cfg) if cfg is not None else (p0, opt.init(p0))

    @jax.jit
    def step(p, s):
        g = jax.grad(_softmax_loss)(p, x, y)
        u, s = opt.update(g, s, p)
        p = optim.apply_updates(p, u, s, cfg) if cfg is not None else optax.apply_updates(p, u)
        return p, s

    for _ in range(steps):
        p, s = step(p, s)
    return float(_softmax_loss(p, x, y)), p, s


@pytest.mark.parametrize("rounding", ["shift", "stochastic"])
def test_w8_adam_matches_plain_adam_on_classification(rounding):
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 30, 300)
    cfg = q.QSDPConfig.qsdp(8, 8, bucket_size=BUCKET, min_shard_size=128, weight_rounding=rounding)
    plain, _, _ = _train_softmax(optax.adam(sched), None)
    quant, pq, sq = _train_softmax(optim.qsdp(optax.adam(sched), cfg), cfg)
    st = optim.find_qsdp_state(sq)
    assert _on_grid(pq["w"], st.scales["w"], st.offsets["w"], 8)
    assert plain < 0.1  # it learned (log(10) = 2.3 at chance)
    print(f"plain adam {plain:.5f}  {cfg.name} adam {quant:.5f}")
    assert abs(quant - plain) / plain < 0.02, (quant, plain)


@pytest.mark.parametrize("rounding,bits", [("shift", 3), ("stochastic", 1)])
def test_projection_lands_on_the_grid_and_is_unbiased(rounding, bits):
    """The projection after update ``t`` for t = 1..n (each its own key) lands on the grid, and
    its mean over t is the exact update to 5 sigma per element; it really is random. (One
    jitted vmap over the update count: seconds, where a loop over seeds retraced per seed.)"""
    n = 400
    p = {"w": jnp.asarray(np.random.default_rng(3).normal(size=(BUCKET * 4,)), jnp.float32)}
    g = {"w": jnp.full((BUCKET * 4,), 0.3, jnp.float32)}
    target = np.asarray(p["w"] - 0.01 * g["w"])
    cfg = q.QSDPConfig.qsdp(bits, 8, bucket_size=BUCKET, min_shard_size=1, weight_rounding=rounding)
    opt = optim.qsdp(optax.sgd(0.01), cfg)
    start = opt.init(p)

    # p, g and the state are arguments, not closure constants: with constants XLA folds the
    # scales into the program, proves them non-negative and drops the select that keeps
    # `lo - xi * s` from becoming an FMA in one fusion and not in another (seen at O0)
    @jax.jit
    @functools.partial(jax.vmap, in_axes=(0, None, None, None))
    def project(count, p, g, start):
        u, st = opt.update(g, dataclasses.replace(start, count=count), p)
        return optim.apply_updates(p, u, st, cfg)["w"], st.scales["w"], st.offsets["w"]

    outs, scales, offsets = (np.asarray(a) for a in project(jnp.arange(n, dtype=jnp.int32), p, g, start))
    for k in (0, n // 2, n - 1):
        assert _on_grid(outs[k], scales[k], offsets[k], bits)
    intervals = 2**bits - 2 if rounding == "shift" else 2**bits - 1
    step = (np.ptp(target.reshape(-1, BUCKET), axis=1) / intervals).repeat(BUCKET)
    assert np.all(np.abs(outs.mean(0) - target) < 5 * step / (2 * np.sqrt(n)))
    assert np.std(outs, 0).mean() > 0.05 * step.mean()


def test_works_with_flax_nnx_optimizer():
    model = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
    cfg = q.QSDPConfig.qsdp(6, 8, bucket_size=BUCKET, min_shard_size=256)
    tx = optim.qsdp(optax.adam(1e-2), cfg)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jnp.ones((4, 32))

    def loss(m):
        return jnp.mean(m(x) ** 2)

    before = float(loss(model))
    for _ in range(5):
        grads = nnx.grad(loss)(model)
        opt.update(model, grads)
    assert float(loss(model)) < before
    kernel = np.asarray(model.kernel[...]).reshape(-1)
    # 512 weights in 8 buckets: at most 2**6 levels each (float rounding of apply_updates aside)
    assert max(len(np.unique(np.round(r, 5))) for r in kernel.reshape(8, BUCKET)) <= 64
