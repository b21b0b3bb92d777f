"""Layer gathers hidden behind compute (``make_train_step(..., overlap=True)``): on XLA:GPU every
collective of the forward and backward layer loops has a matmul scheduled between its start and
done, read from the program compiled ahead of time for 8 H100s (skipped without the CUDA
plugin); with ``overlap=False`` the forward gather is exposed, as it was. On CPU the step is
compiled as before."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import optax
import pytest

import qsdp_jax as q
from experiments.gpt.model import GPT, GPTConfig
from experiments.shelf import schedule, targets
from qsdp_jax._src.collective.overlap import GPU_OPTIONS, compiler_options

NO_CUDA = importlib.util.find_spec("jax_cuda13_plugin") is None


def _loop_overlap(config: q.QSDPConfig, overlap: bool) -> dict:
    devices = targets.devices(targets.TARGETS["h100-8"])
    mesh = q.make_mesh(devices=devices)
    model = GPT(GPTConfig(seq_len=1024, d_model=768, n_layers=4, n_heads=12, vocab_size=1024))  # GPT-125M layers
    opt = q.optim.qsdp(optax.adam(1e-3), config)
    state = q.abstract_train_state(model.abstract_params(), opt, mesh, config, stacked=model.stacked_groups)
    batch = {k: jax.ShapeDtypeStruct((8, model.cfg.seq_len), jnp.int32) for k in ("inputs", "targets")}
    step = q.make_train_step(model.loss, opt, mesh, config, overlap=overlap)
    text = step.lower(state, batch).compile().as_text()
    return schedule.summary(schedule.sites(text))


@pytest.mark.skipif(NO_CUDA, reason="the CUDA plugin is not installed")
@pytest.mark.parametrize(
    "config", [q.QSDPConfig.fp32(), q.QSDPConfig.qsdp(8, 8, kernels="reference")], ids=["fp32", "W8G8"]
)
def test_every_layer_loop_collective_is_hidden_on_h100(config):
    found = _loop_overlap(config, overlap=True)
    for name in ("forward loop", "backward loop"):
        row = found[name]
        assert row["collectives"] >= 1 and row["hidden"] == row["collectives"], (name, found)
    plain = _loop_overlap(config, overlap=False)
    assert plain["forward loop"]["hidden"] == 0, plain  # the compiler's defaults: exposed


def test_options_are_for_gpus_only_and_a_switch():
    assert compiler_options(q.make_mesh(), True) is None  # CPU devices: the defaults
    assert compiler_options(q.make_mesh(), False) is None
    with pytest.raises(TypeError, match="overlap='yes'"):
        q.make_train_step(lambda p, b: 0.0, optax.sgd(0.1), q.make_mesh(), q.QSDPConfig.fp32(), overlap="yes")


@pytest.mark.skipif(NO_CUDA, reason="the CUDA plugin is not installed")
def test_a_gpu_mesh_gets_the_pipelining_options():
    mesh = q.make_mesh(devices=targets.devices(targets.TARGETS["h100-8"]))
    assert compiler_options(mesh, True) == GPU_OPTIONS
    assert compiler_options(mesh, False) is None


@pytest.mark.skipif(NO_CUDA, reason="the CUDA plugin is not installed")
def test_the_nnx_front_door_compiles_for_gpus_with_the_options():
    """The NNX step nests the core step in its own jit, which alone carries the options (JAX
    refuses compiler options on a nested jit); a list of blocks compiles for 8 H100s."""
    from flax import nnx

    from experiments.gpt.model_nnx import GPTListModel, gpt_loss
    from qsdp_jax import nnx as qnnx

    mesh = q.make_mesh(devices=targets.devices(targets.TARGETS["h100-8"]))
    cfg = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4)
    model = nnx.eval_shape(lambda: GPTListModel.init(cfg, 0))
    config = q.QSDPConfig.qsdp(8, 8, bucket_size=64, min_shard_size=128, kernels="reference")
    opt = q.optim.qsdp(optax.adam(1e-3), config)
    state = qnnx.abstract_state(model, opt, mesh, config)
    batch = {k: jax.ShapeDtypeStruct((8, 16), jnp.int32) for k in ("inputs", "targets")}
    for step in (
        qnnx.make_train_step(model, gpt_loss, opt, mesh, config),
        qnnx.make_eval_step(model, gpt_loss, mesh, config),
    ):
        assert "all-gather-start" in step.lower(state, batch).compile().as_text()


def test_blocks_are_chained_by_default_except_under_the_gpu_pipelining():
    from qsdp_jax._src.collective.overlap import scan_blocks_default

    mesh = q.make_mesh()  # XLA:CPU devices: no options, chained
    assert scan_blocks_default(mesh, True) and scan_blocks_default(mesh, False)


@pytest.mark.skipif(NO_CUDA, reason="the CUDA plugin is not installed")
def test_gpu_blocks_are_unrolled_under_the_pipelining_and_chained_without_it():
    from qsdp_jax._src.collective.overlap import scan_blocks_default

    mesh = q.make_mesh(devices=targets.devices(targets.TARGETS["h100-8"]))
    assert not scan_blocks_default(mesh, True) and scan_blocks_default(mesh, False)
