"""optim.compact_moments: per-parameter optimizer state in bfloat16, rounded stochastically.

The rounding is unbiased and lands on a neighbour; an average that moves by less than half a
bfloat16 step per update still follows its float32 twin (round-to-nearest freezes it); only the
parameter-shaped leaves are compacted; sharded training stores them sharded like their parameter;
a checkpoint restores them bit for bit and the resumed run continues exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsdp_jax as q
import toymodel
from qsdp_jax import optim
from qsdp_jax.checkpoint import Checkpointer

SMALL = dict(bucket_size=64, min_shard_size=128)


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values just below and just above |x| in magnitude, with x's sign."""
    bits = x.view(np.uint32)
    low = (bits & np.uint32(0xFFFF0000)).view(np.float32)
    high = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
    return low, high


def test_rounding_is_unbiased_and_lands_on_a_neighbour():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(512) * 10.0 ** rng.integers(-20, 20, 512)).astype(np.float32)
    x[:8] = np.float32(1.5e-40) * np.arange(1, 9)  # subnormals
    x[8:12] = [-3.0e38, 3.2e38, 1.0e38, -2.5e-39]
    n = 400
    draws = jax.jit(jax.vmap(lambda k: optim.stochastic_bfloat16(jnp.asarray(x), k)))(jnp.arange(n, dtype=jnp.uint32))
    draws = np.asarray(draws.astype(jnp.float32))
    low, high = _neighbours(x)
    assert np.all((draws == low) | (draws == high))
    frac = (np.abs(x) - np.abs(low)) / (np.abs(high) - np.abs(low))  # P(round away from zero)
    p_up = (draws == high).mean(0)
    bound = 5 * np.sqrt(frac * (1 - frac) / n) + 1.0 / n
    assert np.all(np.abs(p_up - frac) <= bound), np.max(np.abs(p_up - frac) - bound)
    # values already on bfloat16, zeros and infinities stay as they are; NaN stays NaN
    exact = jnp.asarray([0.0, -0.0, 1.0, -2.5, 2.0**127, np.inf, -np.inf], jnp.float32)
    np.testing.assert_array_equal(np.asarray(optim.stochastic_bfloat16(exact, jnp.uint32(7)), np.float32), exact)
    assert np.isnan(np.asarray(optim.stochastic_bfloat16(jnp.asarray([np.nan]), jnp.uint32(7)), np.float32)).all()
    # above the largest finite bfloat16 a finite value saturates, never rounds to infinity
    top = jnp.asarray([3.4e38, -3.4e38, np.finfo(np.float32).max], jnp.float32)
    many = jax.vmap(lambda k: optim.stochastic_bfloat16(top, k))(jnp.arange(64, dtype=jnp.uint32))
    big = float(jnp.finfo(jnp.bfloat16).max)
    np.testing.assert_array_equal(np.abs(np.asarray(many, np.float32)), big)


def test_a_sharded_array_rounds_as_the_whole_one():
    """Element ids are global: 8 shards draw the bits one array draws."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, 24)), jnp.float32) * 1e-3
    mesh = q.make_mesh()
    sharded = jax.device_put(x, jax.NamedSharding(mesh, jax.P(None, "fsdp")))
    got = jax.jit(optim.stochastic_bfloat16)(sharded, jnp.uint32(11))
    assert got.sharding.spec == jax.P(None, "fsdp")
    np.testing.assert_array_equal(
        np.asarray(got, np.float32), np.asarray(optim.stochastic_bfloat16(x, jnp.uint32(11)), np.float32)
    )


def test_an_average_that_moves_less_than_half_a_step_still_moves():
    """Adam's nu with b2=0.999 and g^2 = 1: each update moves it by 0.1% of the gap, under half a
    bfloat16 step once it nears 1. Round-to-nearest freezes it; stochastic rounding follows the
    float32 average within 1%."""
    steps, b2 = 3000, 0.999
    want = 1 - b2**steps  # the float32 average: 0.950

    def nearest(nu, _):
        return (b2 * nu.astype(jnp.float32) + (1 - b2)).astype(jnp.bfloat16), None

    frozen, _ = jax.lax.scan(nearest, jnp.zeros(1024, jnp.bfloat16), None, length=steps)
    assert float(frozen.astype(jnp.float32).mean()) < 0.8 * want  # stuck far below

    opt = optim.compact_moments(optax.scale_by_adam(b1=0.9, b2=b2))
    params = {"w": jnp.zeros(1024)}
    grads = {"w": jnp.ones(1024)}

    def step(state, _):
        return opt.update(grads, state, params)[1], None

    state, _ = jax.jit(lambda s: jax.lax.scan(step, s, None, length=steps))(opt.init(params))
    nu = state.inner.nu["w"]
    assert nu.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(nu.astype(jnp.float32).mean()), want, rtol=0.01)
    assert int(state.count) == steps


def test_only_parameter_shaped_leaves_are_compacted():
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    adamw = optim.compact_moments(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2))
    state = adamw.init(params)
    inner = state.inner.inner_state[0]
    assert {x.dtype for x in jax.tree.leaves((inner.mu, inner.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert state.inner.hyperparams["learning_rate"].dtype == jnp.float32  # a hyperparameter, not a moment
    # two leaves holding the same values draw their own bits: two traces of one gradient
    twice = optim.compact_moments(optax.chain(optax.trace(0.0), optax.trace(0.0)))
    g = {"w": jnp.full((64, 32), 0.3), "b": jnp.full(32, 0.3)}
    _, st = twice.update(g, twice.init(params), params)
    first, second = (np.asarray(t.trace["w"], np.float32) for t in st.inner)
    assert not np.array_equal(first, second) and set(np.unique(first)) == set(np.unique(second))
    factored = optim.compact_moments(optax.adafactor(1e-2, min_dim_size_to_factor=8)).init(params)
    stats = factored.inner[0]
    assert stats.v_row["w"].dtype == stats.v_col["w"].dtype == jnp.float32  # factored: not a moment's shape
    assert stats.v["b"].dtype == jnp.bfloat16  # b is not factored: its v is per element
    # a jitted update keeps the stored dtypes and the state's structure
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.1), params)
    _, new = jax.jit(adamw.update)(grads, state, params)
    assert jax.tree.structure(new) == jax.tree.structure(state)
    assert [x.dtype for x in jax.tree.leaves(new)] == [x.dtype for x in jax.tree.leaves(state)]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(dtype="int8"), "dtype='int8' is invalid"),
        (dict(seed=-1), "seed=-1 is invalid"),
        (dict(seed=2**32), "seed=4294967296 is invalid"),
        (dict(seed=True), "seed=True is invalid"),
    ],
)
def test_bad_arguments_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        optim.compact_moments(optax.adam(1e-3), **bad)


def _setup(mesh, compact=True):
    cfg = q.QSDPConfig.qsdp(8, 8, **SMALL)
    adamw = optax.adamw(1e-2, weight_decay=0.1)
    opt = optim.qsdp(optim.compact_moments(adamw, seed=5) if compact else adamw, cfg)
    state = q.init_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
    return cfg, state, q.make_train_step(toymodel.loss, opt, mesh, cfg, donate=False)


def test_sharded_state_is_bfloat16_sharded_like_its_parameter_and_resumes_exactly(tmp_path):
    mesh = q.make_mesh()
    cfg, state0, step = _setup(mesh)
    adam = state0.opt_state.inner.inner[0]
    for p, mu, nu in zip(*(jax.tree.leaves(t) for t in (state0.params, adam.mu, adam.nu))):
        assert mu.dtype == nu.dtype == jnp.bfloat16
        assert mu.sharding.spec == nu.sharding.spec == p.sharding.spec
    half, _ = toymodel.run(step, state0, 0, 3)
    straight, losses = toymodel.run(step, half, 3, 6)
    _, wide0, wide_step = _setup(mesh, compact=False)
    _, wide_losses = toymodel.run(wide_step, wide0, 0, 6)
    np.testing.assert_allclose(losses, wide_losses[3:], rtol=2e-2)  # trains like float32 moments
    assert losses != wide_losses[3:]  # but is not them
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(half, cfg, mesh)
        back, _ = ckpt.restore(state0, cfg, mesh)
    resumed, losses2 = toymodel.run(step, back, 3, 6)
    assert losses2 == losses
    for a, b in zip(
        jax.tree.leaves((resumed.params, resumed.opt_state)), jax.tree.leaves((straight.params, straight.opt_state))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_optax_tree_map_params_sees_the_moments():
    """``optax.tree_map_params`` (how GSPMD users shard an optimizer state) calls ``init`` on
    placeholders: the state's tree must not depend on the params' shapes."""
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    opt = optim.compact_moments(optax.adam(1e-2))
    mapped = optax.tree_map_params(opt, lambda p: p.shape, opt.init(params), transform_non_params=lambda _: None)
    assert mapped.inner[0].mu == mapped.inner[0].nu == {"w": (64, 32), "b": (32,)}
    assert mapped.count is None


def test_an_inner_state_that_changes_its_structure_is_refused():
    grows = optax.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, (jnp.zeros(3),)))
    opt = optim.compact_moments(grows)
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="has 1 leaves after an update but 0 at init"):
        opt.update(params, opt.init(params), params)
