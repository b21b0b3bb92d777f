"""``ParamAccess.take``: embedding rows read from the devices' blocks in the sharded step, against
``jnp.take`` of the gathered table, against one device, and code-held against float32-held."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsdp_jax as q

SMALL = dict(bucket_size=64, min_shard_size=128)
V, D, B, T = 64, 32, 8, 6  # 48 ids on 8 devices: tok and wide read as rows, pos gathered
MESHES = {
    "1d": ({"fsdp": 8}, {}),
    "node-local": ({"node": 2, "local": 4}, dict(axis_name="local", node_axis="node")),
    "replica-fsdp": ({"replica": 2, "fsdp": 4}, dict(replica_axis="replica")),
}


def init(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "embed": {
            "tok": jax.random.normal(k[0], (V, D)) * 0.3,  # split on its rows
            "wide": jax.random.normal(k[1], (60, D // 2)) * 0.3,  # 60 rows: split on dim 1
            "small": jax.random.normal(k[2], (5, 4)),  # replicated (under min_shard_size)
            "pos": jax.random.normal(k[2], (T, D)) * 0.3,  # fewer rows than ids: gathered whole
        },
        "head": {"w": jax.random.normal(k[3], (D, 8)) / np.sqrt(D)},
    }


def batch(seed=0):
    r = np.random.default_rng(seed)
    return {
        "ids": jnp.asarray(r.integers(0, V, (B, T)), jnp.int32),
        "y": jnp.asarray(r.normal(size=(B, 8)), jnp.float32),
    }


def _rows(read, ids):
    tok = read("embed/tok", ids)
    wide = read("embed/wide", ids % 60)
    small = read("embed/small", ids % 5)
    pos = read("embed/pos", jnp.arange(ids.shape[-1]))[None]
    return tok + jnp.tile(wide, 2) + jnp.tile(small, D // 4) + pos


def _loss(read, tied):
    def loss(p, batch):
        h = jnp.tanh(_rows(lambda path, ids: read(p, path, ids), batch["ids"]))
        y = h.mean(1) @ p.gather("head")["w"]
        out = jnp.mean((y - batch["y"]) ** 2)
        if tied:  # the table gathered for an output projection, as a tied LM head does
            out = out + jnp.mean((h @ p.gather("embed")["tok"].T) ** 2)
        return out

    return loss


def _by_gather(p, path, ids):
    group, *keys = path.split("/")
    leaf = p.gather(group)
    for k in keys:
        leaf = leaf[k]
    return jnp.take(leaf, ids, axis=0)


taken = _loss(lambda p, path, ids: p.take(path, ids), tied=True)
gathered = _loss(_by_gather, tied=True)


def _run(config, loss, axes=None, steps=3, opt=None):
    mesh = q.make_mesh(axes) if axes else q.make_mesh()
    opt = q.optim.qsdp(opt or optax.adam(1e-2), config)
    state = q.init_train_state(init(), opt, mesh, config)
    step = q.make_train_step(loss, opt, mesh, config)
    compiled = step.lower(state, batch(0)).compile()
    losses = []
    for i in range(steps):
        state, metrics = compiled(state, batch(i))
        losses.append(float(metrics["loss"]))
    return losses, state, compiled


CONFIGS = {
    "fp32": q.QSDPConfig.fp32(**SMALL),
    "W8G8": q.QSDPConfig.qsdp(8, 8, **SMALL),
    "W8G8-codes": dataclasses.replace(q.QSDPConfig.qsdp(8, 8, **SMALL), weight_storage="codes"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_take_trains_like_take_of_the_gathered_table(name):
    config = CONFIGS[name]
    on, on_state, _ = _run(config, taken)
    off, off_state, _ = _run(config, gathered)
    assert on[0] == off[0]  # the same rows: the gather is lossless (fp32, on the grid)
    np.testing.assert_allclose(on, off, rtol=1e-3)
    if config.weight_bits is None:  # the gradients differ in summation order only
        chex.assert_trees_all_close(q.gather_params(on_state), q.gather_params(off_state), rtol=1e-5, atol=1e-5)
    # W8G8: the lookups' gradients are exact instead of quantized, so the rows no id touched get
    # no rounding noise (a sparse table's weights move differently under adam); the step's
    # arithmetic is pinned by the code-held test below and by one device in fp32


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_take_step_matches_one_device(mesh_name):
    """Quantization off, plain SGD: one sharded step's weights == one device's, every leaf."""
    axes, placement = MESHES[mesh_name]
    config = q.QSDPConfig.fp32(**SMALL, **placement)
    _, state, _ = _run(config, taken, axes, steps=1, opt=optax.sgd(0.5))
    grads = jax.grad(lambda p: taken(q.LocalParams(p), batch(0)))(init())
    want = jax.tree.map(lambda w, g: w - 0.5 * g, init(), grads)
    chex.assert_trees_all_close(q.gather_params(state), want, rtol=1e-5, atol=1e-6)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), want, init())
    assert min(jax.tree.leaves(moved)) > 0  # every leaf, the lookups' tables too, got a gradient


@pytest.mark.parametrize("bits, mesh_name", [(8, "1d"), (4, "node-local")])
def test_take_of_code_held_weights_trains_bit_for_bit_like_float32_held(bits, mesh_name):
    axes, placement = MESHES[mesh_name]
    config = q.QSDPConfig.qsdp(bits, bits, **SMALL, **placement)
    held, held_state, _ = _run(config, taken, axes, steps=5)
    coded, coded_state, _ = _run(dataclasses.replace(config, weight_storage="codes"), taken, axes, steps=5)
    assert held == coded
    chex.assert_trees_all_equal(q.gather_params(held_state), q.gather_params(coded_state))


def test_the_step_never_builds_a_looked_up_table():
    """Without a tied projection the sharded step holds the tables' blocks and rows, never a
    whole table (``f32[64,32]``), which the gather of the same lookup does build."""
    config = q.QSDPConfig.qsdp(8, 8, **SMALL)
    untied_take = _loss(lambda p, path, ids: p.take(path, ids), tied=False)
    untied_gather = _loss(_by_gather, tied=False)
    hlo = lambda loss: _run(config, loss, steps=0)[2].as_text()  # noqa: E731
    assert "f32[64,32]" not in hlo(untied_take)
    assert "f32[64,32]" in hlo(untied_gather)


def test_bad_takes_name_the_problem():
    params = init()
    local = q.LocalParams(params)
    with pytest.raises(KeyError, match=r"no leaf 'embed/nope'.*embed/tok"):
        local.take("embed/nope", jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match=r"take\('embed/tok'\): ids must be integers"):
        local.take("embed/tok", jnp.zeros(3))
    config = q.QSDPConfig.fp32(**SMALL)

    def run(loss):
        opt = q.optim.qsdp(optax.sgd(0.1), config)
        stacked = {**params, "blocks": {"w": jnp.ones((2, D, D))}}
        state = q.init_train_state(stacked, opt, q.make_mesh(), config, stacked=("blocks",))
        q.make_train_step(loss, opt, q.make_mesh(), config).lower(state, batch(0))

    with pytest.raises(KeyError, match=r"no leaf 'embed/nope' in group 'embed'"):
        run(lambda p, b: p.take("embed/nope", b["ids"]).sum())
    with pytest.raises(TypeError, match=r"ids must be integers"):
        run(lambda p, b: p.take("embed/tok", b["y"]).sum())
    with pytest.raises(ValueError, match=r"group 'blocks' is layer-stacked: read it with scan\(\), not take\(\)"):
        run(lambda p, b: p.take("blocks/w", b["ids"]).sum())
