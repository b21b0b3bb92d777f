"""The NNX GPT (experiments.gpt.model_nnx) through the front door against the ParamAccess GPT and one
device: the same losses (fp32 to float tolerance; QSDP W8G8 bit for bit), per-layer gathers."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qsdp_jax as q
from experiments.gpt.model import GPT, GPTConfig
from experiments.gpt.model_nnx import GPTModel, gpt_loss
from qsdp_jax import comm
from qsdp_jax import nnx as qnnx

CFG = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4)
SMALL = dict(bucket_size=64, min_shard_size=128)
STEPS = 2


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def _batch(i):
    k1, k2 = jax.random.split(jax.random.key(i))
    return {
        "inputs": jax.random.randint(k1, (8, 16), 0, 256, jnp.int32),
        "targets": jax.random.randint(k2, (8, 16), 0, 256, jnp.int32),
    }


def _low_level(config, mesh, lr=1e-2):
    gpt = GPT(CFG)
    opt = q.optim.qsdp(optax.adam(lr), config)
    state = q.init_train_state(gpt.init_params(0), opt, mesh, config, stacked=gpt.stacked_groups)
    step = q.make_train_step(gpt.loss, opt, mesh, config)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return losses, q.gather_params(state)


def _front_door(config, mesh, lr=1e-2):
    model = GPTModel.init(CFG, 0)
    opt = q.optim.qsdp(optax.adam(lr), config)
    state = qnnx.init_state(model, opt, mesh, config)
    step = qnnx.make_train_step(model, gpt_loss, opt, mesh, config)
    compiled = step.lower(state, _batch(0)).compile()  # compiled once, also for comm_report
    losses = []
    for i in range(STEPS):
        state, metrics = compiled(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return losses, state, step, compiled, model


def test_the_module_is_the_paramaccess_gpt():
    params = GPT(CFG).init_params(0)
    model = GPTModel.from_params(CFG, params)
    chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model, nnx.Param)), params)
    x = _batch(0)["inputs"]
    logits = nnx.jit(lambda m, x: m(x))(model, x)  # its own __call__: nnx.scan outside the step
    chex.assert_trees_all_close(logits, jax.jit(GPT(CFG).logits)(params, x), rtol=1e-5, atol=1e-6)
    assert [g.name for g in qnnx.describe(model).groups if g.stacked] == ["blocks"]


def test_fp32_same_losses_as_paramaccess_and_one_device(mesh):
    config = q.QSDPConfig.fp32(**SMALL)
    losses, state, *_, model = _front_door(config, mesh)
    low, low_params = _low_level(config, mesh)
    ref = GPTModel.init(CFG, 0)
    opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(gpt_loss)(model, batch)
        opt.update(model, grads)
        return loss

    ref_losses = [float(ref_step(ref, opt, _batch(i))) for i in range(STEPS)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses == low  # the same step as the ParamAccess path
    qnnx.update(model, state)
    chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model, nnx.Param)), low_params)
    # atol: the key bias has no gradient (softmax ignores it), Adam scales its rounding noise
    chex.assert_trees_all_close(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(ref, nnx.Param)), rtol=1e-4, atol=1e-4
    )


def test_w8g8_is_the_low_level_step_bit_for_bit_and_gathers_per_layer(mesh):
    config = q.QSDPConfig.qsdp(8, 8, **SMALL)
    losses, state, step, compiled, _ = _front_door(config, mesh)
    low, low_params = _low_level(config, mesh)
    assert losses == low
    chex.assert_trees_all_equal(q.gather_params(state), low_params)
    report = comm.comm_report(compiled)
    loops = [c for c in report.collectives if c.kind == "all-gather" and c.count == CFG.n_layers]
    assert len(loops) == 2  # forward and rematerialising backward: one layer per iteration
    assert "blocks                2  per layer" in step.summary(state, _batch(0))
