"""Checkpoints (qsdp_jax.checkpoint): exact resume, resharding 8 -> 4, refusals, atomicity."""

import numpy as np
import optax
import pytest

import jax
import qsdp_jax as q
import toymodel
from qsdp_jax import optim
from qsdp_jax.checkpoint import CheckpointMismatch, Checkpointer

SMALL = dict(bucket_size=64, min_shard_size=128)
K = 3
CONFIGS = {
    "fp32": q.QSDPConfig.fp32(**SMALL),
    "W8G8": q.QSDPConfig.qsdp(8, 8, **SMALL),
    "W4G4": q.QSDPConfig.qsdp(4, 4, weight_rounding="stochastic", **SMALL),
}


def _opt(config):
    return optim.qsdp(optax.chain(optim.clip_by_global_norm(1.0), optax.adam(1e-2)), config)


def _setup(config, n=8):
    mesh = q.make_mesh(devices=jax.devices()[:n])
    opt = _opt(config)
    state = q.init_train_state(toymodel.init(0), opt, mesh, config, stacked=toymodel.STACKED)
    step = q.make_train_step(toymodel.loss, opt, mesh, config, donate=False)
    return mesh, state, step


def _run(step, state, start, stop):
    losses = []
    for i in range(start, stop):
        state, m = step(state, toymodel.batch(i))
        losses.append(float(m["loss"]))
    return state, losses


def _bits(tree):
    return [np.asarray(x).view(np.uint32) if np.asarray(x).dtype == np.float32 else np.asarray(x)
            for x in jax.tree.leaves(tree)]


def _assert_bitwise(a, b):
    for x, y in zip(_bits(a), _bits(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _global_opt(state, mesh):
    from qsdp_jax.checkpoint import export_state

    return {k: np.asarray(v) for k, v in export_state(state, mesh).items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_bit_exact(name, tmp_path):
    """2k steps straight == k steps + save + restore into a fresh process state + k steps."""
    config = CONFIGS[name]
    mesh, state0, step = _setup(config)
    straight, losses = _run(step, state0, 0, 2 * K)
    half, first = _run(step, state0, 0, K)
    with Checkpointer(tmp_path, keep=2) as ckpt:
        ckpt.save(half, config, mesh, extra={"data_position": K})
        ckpt.wait()
        fresh = q.init_train_state(toymodel.init(1), _opt(config), mesh, config, stacked=toymodel.STACKED)
        restored, extra = ckpt.restore(fresh, config, mesh)
    assert extra == {"data_position": K} and int(restored.step) == K
    _assert_bitwise(restored.params, half.params)
    _assert_bitwise(restored.opt_state, half.opt_state)
    resumed, second = _run(step, restored, K, 2 * K)
    assert first + second == losses
    _assert_bitwise(resumed.params, straight.params)
    _assert_bitwise(resumed.opt_state, straight.opt_state)
