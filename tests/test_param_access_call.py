"""``ParamAccess.call``: a group gathered for one function call and again in its backward pass
(reshard after forward in the low-level API), against ``gather`` and one device."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsdp_jax as q
from qsdp_jax import comm

N_BLOCKS, D = 6, 64
SMALL = dict(bucket_size=64, min_shard_size=128)


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def _params():
    keys = jax.random.split(jax.random.key(0), N_BLOCKS + 1)
    p = {f"b{i}": {"w": jax.random.normal(keys[i], (D, D)) / 8, "s": jnp.ones(D)} for i in range(N_BLOCKS)}
    p["out"] = {"w": jax.random.normal(keys[-1], (D, 8)) / 8}
    return p


def _block(w, x):
    return x + jnp.tanh(x @ w["w"]) * w["s"]


def _loss(read):
    def loss(p, batch):
        x = batch["x"]
        for i in range(N_BLOCKS):
            x = read(p, f"b{i}", x)
        return jnp.mean((x @ p.gather("out")["w"] - batch["y"]) ** 2)

    return loss


called = _loss(lambda p, g, x: p.call(g, _block, x))
gathered = _loss(lambda p, g, x: _block(p.gather(g), x))


def _batch(i):
    k1, k2 = jax.random.split(jax.random.key(10 + i))
    return {"x": jax.random.normal(k1, (16, D)), "y": jax.random.normal(k2, (16, 8))}


def _run(mesh, config, loss, steps=3):
    opt = q.optim.qsdp(optax.adam(1e-2), config)
    state = q.init_train_state(_params(), opt, mesh, config)
    step = q.make_train_step(loss, opt, mesh, config)
    compiled = step.lower(state, _batch(0)).compile()
    losses = []
    for i in range(steps):
        state, metrics = compiled(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return losses, q.gather_params(state), compiled


@pytest.mark.parametrize("config", [q.QSDPConfig.fp32(**SMALL), q.QSDPConfig.qsdp(8, 8, **SMALL)], ids=["fp32", "W8G8"])
def test_call_trains_like_gather_and_frees_the_blocks(mesh, config):
    on = _run(mesh, config, called)
    off = _run(mesh, config, gathered)
    # the same arithmetic, but XLA fuses the two programs differently (1 ulp seen in the
    # first loss): adam turns a near-zero gradient's ulps into 4e-5 of weight, and at W8G8 an
    # ulp can send a weight to the neighbouring point of its bucket's grid (0.3% of them here)
    np.testing.assert_allclose(on[0], off[0], rtol=1e-5)
    if config.weight_bits is None:
        chex.assert_trees_all_close(on[1], off[1], rtol=1e-5, atol=1e-4)
    else:
        diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.mean(jnp.abs(a - b))), on[1], off[1]))
        assert max(diffs) < 1e-4
    count = lambda c: sum(x.count for x in comm.comm_report(c).collectives if x.kind == "all-gather")  # noqa: E731
    assert count(on[2]) == count(off[2]) + N_BLOCKS  # each block's gather again in the backward
    peak = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert peak(on[2]) < peak(off[2]) - 2 * 4 * D * D  # 6 blocks held against about two (3 at W8G8)


def test_call_on_one_device_and_its_errors(mesh):
    p, batch = _params(), _batch(0)
    assert called(q.LocalParams(p), batch) == gathered(q.LocalParams(p), batch)
    cfg = q.QSDPConfig.fp32(**SMALL)
    opt = q.optim.qsdp(optax.sgd(1e-2), cfg)
    stacked = {"layers": {"w": jnp.ones((2, D, D)), "v": jnp.ones((2, D, D))}}
    state = q.init_train_state(stacked, opt, mesh, cfg, stacked=("layers",))
    bad = lambda p, b: jnp.sum(p.call("layers", lambda w, x: x @ w["w"][0], b["x"]))  # noqa: E731
    with pytest.raises(ValueError, match=r"'layers' is layer-stacked: read it with scan\(\), not call\(\)"):
        q.make_train_step(bad, opt, mesh, cfg)(state, batch)
    with pytest.raises(KeyError, match="nope"):
        q.make_train_step(lambda p, b: p.call("nope", lambda w: 0.0), opt, mesh, cfg)(state, batch)
    np.testing.assert_allclose(
        float(q.LocalParams(p).call("out", lambda w: jnp.sum(w["w"]))), float(jnp.sum(p["out"]["w"]))
    )
