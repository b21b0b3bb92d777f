"""Reshard after forward in the NNX front door: a group called as a module (a block of an
``nnx.List``) is gathered for its call and again in the backward pass, so the list-of-blocks GPT
holds about one block's weights, as the ``q.nnx.scan`` GPT does, and trains the same."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qsdp_jax as q
from experiments.gpt.model import GPTConfig
from experiments.gpt.model_nnx import GPTListModel, GPTModel, gpt_loss
from qsdp_jax import comm
from qsdp_jax import nnx as qnnx
from tests.test_nnx import mse
from tests.test_nnx_gpt import _batch  # (8, 16) tokens: CFG's seq_len

CFG = GPTConfig(seq_len=16, d_model=32, n_layers=3, n_heads=4)
SMALL = dict(bucket_size=64, min_shard_size=128)
FP32 = q.QSDPConfig.fp32(**SMALL)
W8G8 = q.QSDPConfig.qsdp(8, 8, **SMALL)


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def _train(model, loss_fn, batches, mesh, config, **kw):
    """Losses, final state, the step and its compiled program."""
    opt = q.optim.qsdp(optax.adam(1e-2), config)
    state = qnnx.init_state(model, opt, mesh, config)
    step = qnnx.make_train_step(model, loss_fn, opt, mesh, config, **kw)
    compiled = step.lower(state, batches[0]).compile()
    losses = []
    for b in batches:
        state, metrics = compiled(state, b)
        losses.append(float(metrics["loss"]))
    return losses, state, step, compiled


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def _gathers(compiled, payload):
    return sum(
        c.count for c in comm.comm_report(compiled).collectives if c.kind == "all-gather" and c.payload_bytes == payload
    )


@pytest.mark.parametrize("config", [FP32, W8G8], ids=["fp32", "W8G8"])
def test_list_gpt_trains_like_the_stacked_gpt(mesh, config):
    batches = [_batch(i) for i in range(3)]
    scan_losses, scan_state, _, _ = _train(GPTModel.init(CFG, 0), gpt_loss, batches, mesh, config)
    model = GPTListModel.init(CFG, 0)
    losses, state, step, _ = _train(model, gpt_loss, batches, mesh, config)
    if config.grad_bits is None:  # fp32: the same arithmetic, to float rounding
        np.testing.assert_allclose(losses, scan_losses, rtol=2e-6)
        listed = q.gather_params(state)
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *[listed[f"blocks/{i}"] for i in range(CFG.n_layers)])
        chex.assert_trees_all_close(blocks, q.gather_params(scan_state)["blocks"], rtol=1e-4, atol=1e-5)
    else:  # the same first loss (the same on-grid weights); then other gradient noise (keyed
        # by group and layer: "blocks/i" layer 0 against "blocks" layer i), the same trajectory
        assert losses[0] == scan_losses[0]
        np.testing.assert_allclose(losses, scan_losses, rtol=1e-3)
    text = step.summary(state, batches[0])
    rows = {line[:16].strip(): line[25:36].strip() for line in text.splitlines()[1:-1]}
    assert rows["blocks/0"] == "per call" and rows[f"blocks/{CFG.n_layers - 1}"] == "per call"
    assert rows["embed"] == "whole"  # also read by the tied head: held


def test_reshard_regathers_in_the_backward_and_holds_one_block(mesh):
    batches = [_batch(0), _batch(1)]
    on = _train(GPTListModel.init(CFG, 0), gpt_loss, batches, mesh, W8G8)
    off = _train(GPTListModel.init(CFG, 0), gpt_loss, batches, mesh, W8G8, reshard_after_forward=False)
    assert on[0] == off[0]  # the same losses, bit for bit
    chex.assert_trees_all_equal(q.gather_params(on[1]), q.gather_params(off[1]))
    block = on[1].layout.group("blocks/0").flat_size  # W8G8 payload: one byte a weight + stats
    payload = next(c.payload_bytes for c in comm.comm_report(on[3]).collectives if c.kind == "all-gather")
    per_block = {c.payload_bytes for c in comm.comm_report(on[3]).collectives if c.kind == "all-gather"}
    assert payload in per_block and block > 0
    n_on = sum(c.count for c in comm.comm_report(on[3]).collectives if c.kind == "all-gather")
    n_off = sum(c.count for c in comm.comm_report(off[3]).collectives if c.kind == "all-gather")
    assert n_on == n_off + CFG.n_layers  # each block's gather again in the backward pass
    layer_bytes = 4 * block
    assert _peak(on[3]) < _peak(off[3]) - (CFG.n_layers - 2) * layer_bytes
    assert "per call" in on[2].summary(on[1], batches[0])
    assert "per call" not in off[2].summary(off[1], batches[0])


class StatefulBlock(nnx.Module):
    """A block with model state: dropout (RNG counts advance) and batch statistics."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.drop(self.bn(self.lin(x))))


class StatefulList(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([StatefulBlock(rngs) for _ in range(3)])
        self.out = nnx.Linear(16, 13, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _state_batch(i):
    k1, k2 = jax.random.split(jax.random.key(300 + i))
    return {"x": jax.random.normal(k1, (16, 16)), "y": jax.random.normal(k2, (16, 13))}


def test_model_state_in_resharded_blocks_is_what_the_plain_step_computes(mesh):
    """Dropout masks (drawn once, reused by the backward's re-run) and batch statistics."""
    batches = [_state_batch(i) for i in range(3)]
    cfg = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=64)
    on = _train(StatefulList(nnx.Rngs(0)), mse, batches, mesh, cfg)
    off = _train(StatefulList(nnx.Rngs(0)), mse, batches, mesh, cfg, reshard_after_forward=False)
    np.testing.assert_allclose(on[0], off[0], rtol=1e-6)
    chex.assert_trees_all_close(q.gather_params(on[1]), q.gather_params(off[1]), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(on[1].model_state, off[1].model_state, rtol=1e-5, atol=1e-6)
    model = StatefulList(nnx.Rngs(0))
    qnnx.update(model, on[1])
    assert float(jnp.abs(model.blocks[0].bn.mean.get_value()).sum()) > 0  # statistics were updated
    assert "per call" in on[2].summary(on[1], batches[0])


class Uses(nnx.Module):
    """A block that holds (a graph edge to) another group's module, or is given one."""

    def __init__(self, rngs, shared=None):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.shared = shared

    def __call__(self, x, other=None):
        x = self.lin(x)
        return (other or self.shared)(x)


def _two_ways(model, loss, batches, mesh):
    on = _train(model, loss, batches, mesh, FP32)
    off = _train(model, loss, batches, mesh, FP32, reshard_after_forward=False)
    assert on[0] == off[0]
    chex.assert_trees_all_equal(q.gather_params(on[1]), q.gather_params(off[1]))
    text = on[2].summary(on[1], batches[0])
    return {line[:16].strip(): line[25:36].strip() for line in text.splitlines()[1:-1]}


def test_blocks_sharing_a_module_or_given_one_train_as_without_reshard(mesh):
    batches = [{"x": jax.random.normal(jax.random.key(i), (8, 16))} for i in range(2)]
    model = nnx.Module()  # "a_shared" comes first in nnx's (sorted) walk: the Linear is its group
    model.a_shared = nnx.Linear(16, 16, rngs=nnx.Rngs(1))
    model.blocks = nnx.List([Uses(nnx.Rngs(2), model.a_shared), Uses(nnx.Rngs(3))])
    shares = lambda m, b: jnp.mean((m.blocks[0](b["x"]) - b["x"]) ** 2)  # noqa: E731
    rows = _two_ways(model, shares, batches, mesh)
    assert rows["blocks/0"] == "whole"  # holds another group's module: gathered once and held
    given = lambda m, b: jnp.mean((m.blocks[1](b["x"], m.a_shared) - b["x"]) ** 2)  # noqa: E731
    rows = _two_ways(model, given, batches, mesh)
    assert rows["blocks/1"] == "whole"  # given a module: a plain call
    assert rows["a_shared"] == "per call"  # the module it was given: called, resharded


def test_the_first_trace_runs_only_where_a_group_can_be_resharded(mesh):
    """The abstract trace that finds groups read outside their call costs a second trace of
    the loss: only for a train step with a group called as a module."""
    raw = nnx.Module()  # groups that are bare parameters: nothing to reshard
    raw.w = nnx.Param(jnp.ones((16, 16)))
    raw.v = nnx.Param(jnp.ones((16, 13)))
    traces = []

    def counted(forward):
        def loss(m, b):
            traces.append(1)
            return jnp.mean((forward(m, b["x"]) - b["y"]) ** 2)

        return loss

    cases = [
        (StatefulList(nnx.Rngs(0)), lambda m, x: m(x), {}, 2),
        (StatefulList(nnx.Rngs(0)), lambda m, x: m(x), {"reshard_after_forward": False}, 1),
        (raw, lambda m, x: x @ m.w[...] @ m.v[...], {}, 1),
    ]
    for model, forward, kw, want in cases:
        traces.clear()
        opt = q.optim.qsdp(optax.sgd(1e-2), FP32)
        state = jax.eval_shape(lambda m=model, o=opt: qnnx.init_state(m, o, mesh, FP32))
        qnnx.make_train_step(model, counted(forward), opt, mesh, FP32, **kw).lower(state, _state_batch(0))
        assert len(traces) == want, (kw, len(traces))
