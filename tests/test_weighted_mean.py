"""A loss normalised by a count of its batch (real tokens) trains the one-device objective:
returned as q.WeightedMean, the step sums totals and weights over the devices. Padded batches
whose rows hold different numbers of real tokens on different devices, 8 devices."""

from __future__ import annotations

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qsdp_jax as q
from qsdp_jax import nnx as qnnx

CFG = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=64)
D, T, ROWS = 16, 6, 16


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def _batch(i: int) -> dict:
    """Rows padded to different lengths: device 0's two rows are almost all padding, the last
    device's are full, so the devices' own token counts differ by 5x."""
    k1, k2 = jax.random.split(jax.random.key(300 + i))
    lengths = np.array([1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 6, 6, 6, 6])
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    return {
        "x": jax.random.normal(k1, (ROWS, T, D)),
        "y": jax.random.normal(k2, (ROWS, T, D)),
        "mask": jnp.asarray(mask),
    }


def _token_losses(w, b):
    return jnp.mean((b["x"] @ w - b["y"]) ** 2, axis=-1)  # (rows, T)


def weighted(p, b):
    tok = _token_losses(p.gather("m")["w"], b)
    return q.WeightedMean(total=jnp.sum(tok * b["mask"]), weight=jnp.sum(b["mask"]))


def local_mean(p, b):  # the usual one-device code: divide by this batch's real tokens
    tok = _token_losses(p.gather("m")["w"], b)
    return jnp.sum(tok * b["mask"]) / jnp.sum(b["mask"])


def _one_device(params, steps):
    opt = optax.adam(1e-2)
    state = opt.init(params)
    losses = []
    for i in range(steps):
        b = _batch(i)
        loss, g = jax.value_and_grad(lambda p: local_mean(q.LocalParams(p), b))(params)  # noqa: B023
        u, state = opt.update(g, state, params)
        params = optax.apply_updates(params, u)
        losses.append(float(loss))
    return losses, params


def _sharded(mesh, loss_fn, params, steps):
    opt = q.optim.qsdp(optax.adam(1e-2), CFG)
    state = q.init_train_state(params, opt, mesh, CFG)
    step = q.make_train_step(loss_fn, opt, mesh, CFG)
    losses = []
    for i in range(steps):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return losses, state


def _params():
    return {"m": {"w": jax.random.normal(jax.random.key(0), (D, D)) * 0.3}}


def test_weighted_mean_trains_the_one_device_objective(mesh):
    want_losses, want = _one_device(_params(), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", q.LocalMeanWarning)  # none: the loss says how it normalises
        losses, state = _sharded(mesh, weighted, _params(), 3)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    chex.assert_trees_all_close(q.gather_params(state), want, rtol=1e-5, atol=1e-6)
    evaluate = q.make_eval_step(weighted, mesh, CFG)
    b = _batch(7)
    one = float(local_mean(q.LocalParams(q.gather_params(state)), b))
    np.testing.assert_allclose(float(evaluate(state, b)), one, rtol=1e-6)


def test_the_mean_of_local_means_differs_and_is_warned_about(mesh):
    """What the step did with the one-device code, silently: another objective."""
    want_losses, _ = _one_device(_params(), 1)
    with pytest.warns(q.LocalMeanWarning, match=r"the batch holds \['mask'\] and the loss is a plain scalar"):
        losses, _ = _sharded(mesh, local_mean, _params(), 1)
    assert abs(losses[0] - want_losses[0]) > 1e-3 * abs(want_losses[0]), (losses, want_losses)


def test_weighted_mean_on_one_device_and_bad_fields(mesh):
    m = q.WeightedMean(total=jnp.float32(6.0), weight=jnp.float32(4.0))
    assert float(m.value) == 1.5 and float(q.WeightedMean(jnp.float32(0.0), jnp.float32(0.0)).value) == 0.0
    opt = q.optim.qsdp(optax.adam(1e-2), CFG)
    state = q.init_train_state(_params(), opt, mesh, CFG)

    def per_token(p, b):  # a vector where the sum belongs
        tok = _token_losses(p.gather("m")["w"], b)
        return q.WeightedMean(total=tok * b["mask"], weight=jnp.sum(b["mask"]))

    with pytest.raises(
        ValueError, match=r"WeightedMean.total must be a scalar \(the sum over this batch\), got shape \(2, 6\)"
    ):
        q.make_train_step(per_token, opt, mesh, CFG)(state, _batch(0))


class TinyLM(nnx.Module):
    def __init__(self, rngs, vocab=32, d=16):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.mlp = nnx.Linear(d, d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        return self.head(jax.nn.gelu(self.mlp(self.embed(tokens))))


def _lm_batch(i):
    b = _batch(i)
    tokens = jax.random.randint(jax.random.key(400 + i), (ROWS, T + 1), 1, 32)
    tokens = jnp.where(jnp.concatenate([b["mask"], b["mask"][:, -1:]], 1) > 0, tokens, 0)  # pad id 0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "input_mask": b["mask"] > 0}


def lm_weighted(model, b):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(b["inputs"]), b["targets"])
    mask = b["input_mask"].astype(jnp.float32)
    return q.WeightedMean(total=jnp.sum(losses * mask), weight=jnp.sum(mask))


def test_nnx_lm_with_padded_rows_matches_one_device(mesh):
    """The Flax Gemma example's objective (summed token losses over the batch's real tokens)
    through q.nnx.make_train_step: one device's losses and weights over 4 steps."""
    model, ref = TinyLM(nnx.Rngs(0)), TinyLM(nnx.Rngs(0))
    opt = q.optim.qsdp(optax.adam(1e-2), CFG)
    state = qnnx.init_state(model, opt, mesh, CFG)
    step = qnnx.make_train_step(model, lm_weighted, opt, mesh, CFG)
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def ref_step(m, o, b):
        loss, grads = nnx.value_and_grad(lambda m: lm_weighted(m, b).value)(m)
        o.update(m, grads)
        return loss

    for i in range(4):
        b = _lm_batch(i)
        state, metrics = step(state, b)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_step(ref, ref_opt, b)), rtol=1e-6)
    qnnx.update(model, state)
    pure = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Param))  # noqa: E731
    chex.assert_trees_all_close(pure(model), pure(ref), rtol=1e-5, atol=1e-6)
