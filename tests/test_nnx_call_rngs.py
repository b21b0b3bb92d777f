"""Dropout with rngs passed to __call__ (NNX's documented style, the Flax Gemma example's):
make_train_step(..., rngs=nnx.Rngs(dropout=0)) calls loss_fn(model, batch, rngs=...), each
step and device drawing fresh keys; an outer nnx.Rngs closed over is a clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qsdp_jax as q
from qsdp_jax import nnx as qnnx

CFG = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=64)


class CallDropout(nnx.Module):
    """Dropout built without rngs; its keys come with the call."""

    def __init__(self, rngs, d=16):
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.out = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x, *, rngs=None):
        return self.out(self.drop(jax.nn.relu(self.lin(x)), rngs=rngs))[:, 0]


def loss_fn(model, batch, rngs):
    return jnp.mean((model(batch["x"], rngs=rngs) - batch["y"]) ** 2)


def _batch():
    k1, k2 = jax.random.split(jax.random.key(7))
    return {"x": jax.random.normal(k1, (16, 16)), "y": jax.random.normal(k2, (16,))}


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def _losses(mesh, seed: int, steps: int = 3):
    model = CallDropout(nnx.Rngs(0))
    opt = q.optim.qsdp(optax.sgd(0.0), CFG)  # weights fixed: only the masks change the loss
    state = qnnx.init_state(model, opt, mesh, CFG)
    step = qnnx.make_train_step(model, loss_fn, opt, mesh, CFG, rngs=nnx.Rngs(dropout=seed))
    out = []
    for _ in range(steps):
        state, metrics = step(state, _batch())
        out.append(float(metrics["loss"]))
    return out, model, state


def test_rngs_passed_to_the_call_draw_fresh_masks_each_step_reproducibly(mesh):
    losses, model, state = _losses(mesh, seed=1)
    assert len(set(losses)) == 3, losses  # a fresh mask every step (same weights, same batch)
    assert _losses(mesh, seed=1)[0] == losses  # a pure function of (keys, step, device): resumable
    assert _losses(mesh, seed=2)[0] != losses
    evaluate = qnnx.make_eval_step(model, loss_fn, mesh, CFG, rngs=nnx.Rngs(dropout=1))
    qnnx.update(model, state)
    model.eval()
    want = float(loss_fn(model, _batch(), None))  # eval mode: no dropout, no keys drawn
    np.testing.assert_allclose(float(evaluate(state, _batch())), want, rtol=1e-6)


def test_an_outer_rngs_closed_over_is_a_clear_error(mesh):
    model = CallDropout(nnx.Rngs(0))
    opt = q.optim.qsdp(optax.sgd(1e-2), CFG)
    state = qnnx.init_state(model, opt, mesh, CFG)
    outer = nnx.Rngs(dropout=0)
    step = qnnx.make_train_step(model, lambda m, b: loss_fn(m, b, outer), opt, mesh, CFG)
    with pytest.raises(
        ValueError, match=r"made outside the step.*make_train_step\(\.\.\., rngs=nnx.Rngs\(dropout=0\)\)"
    ):
        step(state, _batch())
    with pytest.raises(TypeError, match="rngs must be an nnx.Rngs"):
        qnnx.make_train_step(model, loss_fn, opt, mesh, CFG, rngs=0)
