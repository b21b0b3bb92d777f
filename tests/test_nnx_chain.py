"""Blocks of an ``nnx.List`` called in a loop run as one scan (``qsdp_jax._src.nnx.chain``): one
compiled body per distinct block graph, the values and gradients of the unrolled calls."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qsdp_jax as q
from qsdp_jax import nnx as qnnx

SMALL = dict(bucket_size=64, min_shard_size=64)
FP32 = q.QSDPConfig.fp32(**SMALL)
W8G8 = q.QSDPConfig.qsdp(8, 8, **SMALL)
D = 32


class Block(nnx.Module):
    """Alike parameters; ``local`` a static attribute (a local and a global attention layer)."""

    def __init__(self, rngs, local: bool):
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)
        self.local = local

    def __call__(self, x, mask, scale=1.0):
        h = jax.nn.gelu(self.up(self.norm(x)))
        if self.local:
            h = h * mask[..., None]
        return x + scale * self.down(h)


class Net(nnx.Module):
    def __init__(self, rngs, n=4, between=None, keep=False):
        self.embed = nnx.Linear(8, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs, local=i % 3 != 2) for i in range(n)])
        self.head = nnx.Linear(D, 8, rngs=rngs)
        self.between, self.keep = between, keep

    def __call__(self, x, mask):
        x = self.embed(x)
        kept = []
        for block in self.blocks:
            x = block(x, mask, scale=0.5)
            kept.append(x)
            if self.between is not None:
                x = self.between(x)
        if self.keep:  # every block's output read (a skip connection to the head)
            x = x + sum(kept) / len(kept)
        return self.head(x)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"], batch["gate"]) - batch["y"]) ** 2)


def _batch(i, rows=16):
    k1, k2, k3 = jax.random.split(jax.random.key(50 + i), 3)
    return {
        "x": jax.random.normal(k1, (rows, 6, 8)),
        "gate": (jax.random.uniform(k2, (rows, 6)) > 0.3).astype(jnp.float32),
        "y": jax.random.normal(k3, (rows, 6, 8)),
    }


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def _run(model_fn, config, mesh, steps=3, **kw):
    model = model_fn()
    opt = q.optim.qsdp(optax.adam(1e-2), config)
    state = qnnx.init_state(model, opt, mesh, config)
    step = qnnx.make_train_step(model, loss_fn, opt, mesh, config, **kw)
    losses = []
    for i in range(steps):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return losses, q.gather_params(state), step, state


def _dots(model_fn, **kw) -> int:
    """Matmuls in the lowered step (StableHLO): one body's for a chain, one per block unrolled."""
    model = model_fn()
    opt = q.optim.qsdp(optax.adam(1e-2), FP32)
    state = jax.eval_shape(lambda: qnnx.init_state(model, opt, q.make_mesh(), FP32))
    step = qnnx.make_train_step(model, loss_fn, opt, q.make_mesh(), FP32, **kw)
    return len(re.findall(r"stablehlo\.dot_general", step.lower(state, _batch(0)).as_text()))


def _one_device(model_fn, steps=3):
    model = model_fn()
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(train(model, opt, _batch(i))) for i in range(steps)]
    return losses, nnx.state(model, nnx.Param)


def test_a_chain_compiles_one_body_and_equals_the_unrolled_calls_and_one_device(mesh):
    net = lambda n=4: Net(nnx.Rngs(0), n=n)  # noqa: E731
    scanned, params, step, state = _run(net, FP32, mesh)
    unrolled, params_u, step_u, state_u = _run(net, FP32, mesh, scan_blocks=False)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-6)
    chex.assert_trees_all_close(params, params_u, rtol=1e-5, atol=1e-6)
    single, single_params = _one_device(net)
    np.testing.assert_allclose(scanned, single, rtol=1e-5)
    got = params["blocks/3"]["down"]["kernel"]
    np.testing.assert_allclose(got, single_params["blocks"][3]["down"]["kernel"].get_value(), rtol=1e-4, atol=1e-6)
    # the chain's matmuls do not grow with the block count; unrolled they do
    assert _dots(lambda: net(8)) == _dots(net)
    assert _dots(lambda: net(8), scan_blocks=False) > _dots(net, scan_blocks=False) > _dots(net)
    assert "per call" in step.summary(state, _batch(0))


@pytest.mark.parametrize("storage", ["float32", "codes"])
def test_a_w8g8_chain_draws_the_unrolled_calls_noise(mesh, storage):
    """The same gathers and gradient keys (group index, layer 0) as the unrolled calls: the
    same trajectory up to XLA's fusion choices."""
    config = q.QSDPConfig.qsdp(8, 8, weight_storage=storage, **SMALL)
    net = lambda: Net(nnx.Rngs(1))  # noqa: E731
    scanned, params, _, _ = _run(net, config, mesh, steps=3)
    unrolled, params_u, _, _ = _run(net, config, mesh, steps=3, scan_blocks=False)
    assert scanned[0] == unrolled[0]  # the same on-grid weights
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5)
    chex.assert_trees_all_close(params, params_u, rtol=1e-4, atol=1e-5)


def test_every_blocks_output_is_its_own_when_the_loss_keeps_them(mesh):
    net = lambda: Net(nnx.Rngs(2), keep=True)  # noqa: E731
    scanned, params, _, _ = _run(net, FP32, mesh)
    unrolled, params_u, _, _ = _run(net, FP32, mesh, scan_blocks=False)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-6)
    chex.assert_trees_all_close(params, params_u, rtol=1e-5, atol=1e-6)
    assert _dots(net) < _dots(net, scan_blocks=False)  # chained all the same


def test_code_between_the_blocks_unrolls_them(mesh):
    """A block whose input is not the previous block's output as it came out is no chain."""
    net = lambda: Net(nnx.Rngs(3), between=jnp.tanh)  # noqa: E731
    scanned, params, _, _ = _run(net, FP32, mesh, steps=2)
    unrolled, params_u, _, _ = _run(net, FP32, mesh, steps=2, scan_blocks=False)
    assert scanned == unrolled
    chex.assert_trees_all_equal(params, params_u)
    assert _dots(net) == _dots(net, scan_blocks=False)


class Wide(nnx.Module):
    """Blocks of two widths: only the alike neighbours chain."""

    def __init__(self, rngs):
        self.blocks = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(3)] + [nnx.Linear(D, 8, rngs=rngs)])

    def __call__(self, x, mask):
        x = jnp.pad(x, ((0, 0), (0, 0), (0, D - 8)))
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_of_other_shapes_break_the_chain(mesh):
    scanned, params, _, _ = _run(lambda: Wide(nnx.Rngs(4)), FP32, mesh, steps=2)
    unrolled, params_u, _, _ = _run(lambda: Wide(nnx.Rngs(4)), FP32, mesh, steps=2, scan_blocks=False)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-6)
    chex.assert_trees_all_close(params, params_u, rtol=1e-5, atol=1e-6)


def test_a_loss_that_calls_the_blocks_otherwise_on_its_second_trace_is_refused(mesh):
    traces = []

    def fickle(model, batch):
        traces.append(1)
        x = model.embed(batch["x"])
        for i, block in enumerate(model.blocks):
            x = block(x, batch["gate"], scale=0.5 if len(traces) == 1 or i < 2 else 0.25)
        return jnp.mean((model.head(x) - batch["y"]) ** 2)

    model = Net(nnx.Rngs(5))
    opt = q.optim.qsdp(optax.adam(1e-2), FP32)
    state = qnnx.init_state(model, opt, mesh, FP32)
    step = qnnx.make_train_step(model, fickle, opt, mesh, FP32)
    with pytest.raises(RuntimeError, match="differently from its first trace.*scan_blocks=False"):
        step(state, _batch(0))
