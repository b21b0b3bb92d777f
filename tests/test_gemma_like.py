"""A Gemma-3-like model as its authors write it (tests/gemma_like.py: a list of local and global
attention blocks, RoPE, GQA, a tied embedding read through attend, dropout given its keys in
__call__, partitioned parameters and out_sharding annotations, padded batches with a
token-weighted loss) trained by the NNX front door on 8 devices: fp32 equals one device and the
plain GSPMD step on the authors' Explicit mesh over 20 steps; W8G8 with dropout trains."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType

import qsdp_jax as q
from qsdp_jax import nnx as qnnx
from experiments.gpt.gemma_like import GemmaLike, loss_fn, padded_batch

STEPS = 20


def _reference(model, batches, mesh):
    """nnx + optax on the loss's own ratio under ``mesh``: the plain GSPMD step with the model's
    annotations honoured (on a 1-device mesh: one device)."""
    with jax.set_mesh(mesh):
        opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(m, o, b):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, b, nnx.Rngs(dropout=0)).value)(m)
        o.update(m, grads)
        return loss

    out = []
    for b in batches:
        with jax.set_mesh(mesh):
            out.append(float(step(model, opt, b)))
    return out


def _ours(model, batches, mesh, config, rngs_seed=0):
    opt = q.optim.qsdp(optax.adam(3e-3), config)
    state = qnnx.init_state(model, opt, mesh, config)
    step = qnnx.make_train_step(model, loss_fn, opt, mesh, config, rngs=nnx.Rngs(dropout=rngs_seed))
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return losses


def test_fp32_equals_one_device_and_the_gspmd_step_with_pads():
    explicit = jax.make_mesh((8,), ("fsdp",))  # the authors' mesh (Explicit axes)
    ours = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))  # the one-line fix
    batches = [padded_batch(i) for i in range(STEPS)]
    single = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])  # one device
    with jax.set_mesh(explicit):
        model, gspmd_model = GemmaLike(nnx.Rngs(0)), GemmaLike(nnx.Rngs(0))
    with jax.set_mesh(single):
        one_model = GemmaLike(nnx.Rngs(0))  # the same initial weights
    one = _reference(one_model, batches, single)
    gspmd = _reference(gspmd_model, batches, explicit)
    got = _ours(model, batches, ours, q.QSDPConfig.fp32(bucket_size=64, min_shard_size=64))
    np.testing.assert_allclose(got, one, rtol=1e-6)
    np.testing.assert_allclose(got, gspmd, rtol=1e-6)
    assert got[-1] < 0.8 * got[0]  # it learns


def test_w8g8_with_dropout_trains():
    mesh = q.make_mesh()
    with jax.set_mesh(jax.make_mesh((8,), ("fsdp",))):
        model = GemmaLike(nnx.Rngs(0), dropout=0.1)
    batches = [padded_batch(i) for i in range(STEPS)]
    losses = _ours(model, batches[:10], mesh, q.QSDPConfig.qsdp(8, 8, bucket_size=64, min_shard_size=64))
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses
