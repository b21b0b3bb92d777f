"""The Flax NNX front door (qsdp_jax.nnx) on small models: groups and stacks from the module,
sharded step = single device (fp32), per-layer gathers, RNG streams, BatchNorm, clear errors."""

import inspect
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qsdp_jax as q
from qsdp_jax import comm
from qsdp_jax import nnx as qnnx
from qsdp_jax._src.nnx.tree import describe

N = 8
SMALL = dict(bucket_size=64, min_shard_size=64)  # 7x13 = 91 elements: sharded


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


class ListMLP(nnx.Module):
    """Blocks in an nnx.List, and a 7x13 parameter."""

    def __init__(self, rngs, dtype=jnp.float32):
        self.blocks = nnx.List([nnx.Linear(16, 16, param_dtype=dtype, rngs=rngs) for _ in range(3)])
        self.proj = nnx.Linear(16, 7, param_dtype=dtype, rngs=rngs)
        self.odd = nnx.Param(0.3 * jax.random.normal(rngs.params(), (7, 13), dtype))

    def __call__(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return self.proj(x) @ self.odd


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]).astype(jnp.float32) ** 2)


def _mlp_batch(i, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(100 + i))
    return {"x": jax.random.normal(k1, (16, 16), dtype), "y": jax.random.normal(k2, (16, 13), dtype)}


class Block(nnx.Module):
    def __init__(self, d, rngs, dropout=0.0):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.lin(self.ln(x)))


def block_stack(rngs, d, n_layers, dropout=0.0) -> Block:
    """``n_layers`` Blocks stacked with nnx.split_rngs + nnx.vmap (one module, a layer axis)."""

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(d, rngs, dropout)

    return make(rngs)


def run_stack(scan, x, stack):
    """The stack's blocks one after the other: ``scan`` (the drop-in or nnx.scan) + nnx.remat."""

    @scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def trunk(x, block):
        return block(x)

    return trunk(x, stack)


class Stacked(nnx.Module):
    """Blocks stacked with nnx.split_rngs + nnx.vmap; forward: (drop-in) nnx.scan + nnx.remat."""

    def __init__(self, rngs, d=32, n_layers=3, dropout=0.0, scan=qnnx.scan):
        self.inp = nnx.Linear(4, d, rngs=rngs)
        self.blocks = block_stack(rngs, d, n_layers, dropout)
        self.out = nnx.Linear(d, 1, rngs=rngs)
        self.scan = scan

    def __call__(self, x):
        return self.out(run_stack(self.scan, self.inp(x), self.blocks))[:, 0]


def _stacked_batch(i):
    k1, k2 = jax.random.split(jax.random.key(200 + i))
    return {"x": jax.random.normal(k1, (16, 4)), "y": jax.random.normal(k2, (16,))}


def _reference(model, loss_fn, batches, lr):
    """The single-device run: nnx + optax on the global batch."""
    opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, b):
        loss, grads = nnx.value_and_grad(loss_fn)(model, b)
        opt.update(model, grads)
        return loss

    return [float(train_step(model, opt, b)) for b in batches]


def _sharded(model, loss_fn, batches, mesh, config, lr, **kw):
    opt = q.optim.qsdp(optax.adam(lr), config)
    state = qnnx.init_state(model, opt, mesh, config)
    step = qnnx.make_train_step(model, loss_fn, opt, mesh, config, **kw)
    compiled = step.lower(state, batches[0]).compile()  # compiled once, also for comm_report
    losses = []
    for b in batches:
        state, metrics = compiled(state, b)
        losses.append(float(metrics["loss"]))
    return losses, state, step, compiled


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_groups_and_stacks_come_from_the_module():
    groups = {g.name: g for g in describe(ListMLP(nnx.Rngs(0))).groups}
    assert sorted(groups) == ["blocks/0", "blocks/1", "blocks/2", "odd", "proj"]
    assert not any(g.stacked for g in groups.values())
    model = nnx.Module()
    model.parts = nnx.Dict(enc=nnx.Linear(3, 4, rngs=nnx.Rngs(0)), dec=nnx.Linear(4, 3, rngs=nnx.Rngs(1)))
    assert [g.name for g in describe(model).groups] == ["parts/dec", "parts/enc"]
    groups = {g.name: g for g in describe(Stacked(nnx.Rngs(0))).groups}
    assert sorted(groups) == ["blocks", "inp", "out"]
    assert groups["blocks"].stacked and groups["blocks"].n_layers == 3
    assert not groups["inp"].stacked and not groups["out"].stacked
    model = nnx.Module()  # tables of one leading size, all 2-D: not a stack (flax says so)
    model.embed = nnx.Module()
    model.embed.tok, model.embed.pos = nnx.Embed(64, 8, rngs=nnx.Rngs(0)), nnx.Embed(64, 8, rngs=nnx.Rngs(1))
    assert [(g.name, g.stacked) for g in describe(model).groups] == [("embed", False)]
    from experiments.gpt.model import GPTConfig
    from experiments.gpt.model_nnx import GPTModel

    medium = nnx.eval_shape(lambda: GPTModel(GPTConfig.from_preset("medium"), rngs=nnx.Rngs(0)))
    assert [(g.name, g.n_layers) for g in describe(medium).groups if g.stacked] == [("blocks", 8)]


def test_list_mlp_with_a_7x13_parameter_matches_one_device(mesh):
    """fp32 (quantization off): the sharded NNX step is the single-device step, to float
    tolerance; update() puts the weights back into the module."""
    cfg = q.QSDPConfig.fp32(**SMALL)
    batches = [_mlp_batch(i) for i in range(3)]
    model = ListMLP(nnx.Rngs(0))
    losses, state, *_ = _sharded(model, mse, batches, mesh, cfg, 1e-2)
    # 7 x 13 divides over 8 devices on no dimension: kept replicated (init_state warns)
    assert not state.layout.group("odd").is_sharded and state.layout.group("odd").leaves[0].shape == (7, 13)
    ref = ListMLP(nnx.Rngs(0))
    ref_losses = _reference(ref, mse, batches, 1e-2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    qnnx.update(model, state)
    chex.assert_trees_all_close(_params(model), _params(ref), rtol=1e-5, atol=1e-6)
    assert float(mse(model, batches[0])) < ref_losses[0]  # the same loss runs unsharded


def test_bf16_params(mesh):
    cfg = q.QSDPConfig.qsdp(8, 8, **SMALL)
    batches = [_mlp_batch(0, jnp.bfloat16)] * 4
    model = ListMLP(nnx.Rngs(0), jnp.bfloat16)
    first = float(mse(model, batches[0]))
    losses, state, *_ = _sharded(model, mse, batches, mesh, cfg, 3e-2)
    np.testing.assert_allclose(losses[0], first, rtol=2e-2)  # bf16 forward; weights on the grid
    assert losses[-1] < losses[0]
    qnnx.update(model, state)
    assert {x.dtype for x in jax.tree.leaves(_params(model))} == {jnp.dtype(jnp.bfloat16)}


def check_scanned_stack(mesh, make, group: str, n_layers: int = 3):
    """``make(rngs)``'s model, its stack ``group`` read with the drop-in scan: the sharded fp32
    step matches one device, gathers one layer per loop iteration, forward and backward, and
    the summary says so."""
    cfg = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=128)
    batches = [_stacked_batch(i) for i in range(3)]
    model = make(nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*gathered whole")  # none with the drop-in
        losses, state, step, compiled = _sharded(model, mse, batches, mesh, cfg, 1e-2)
    ref = make(nnx.Rngs(0))
    np.testing.assert_allclose(losses, _reference(ref, mse, batches, 1e-2), rtol=1e-5)
    qnnx.update(model, state)
    chex.assert_trees_all_close(_params(model), _params(ref), rtol=1e-5, atol=1e-6)
    # forward and rematerialising backward loops, each one layer's gather per iteration
    report = comm.comm_report(compiled)
    one_layer = 4 * state.layout.group(group).flat_size
    loops = [c for c in report.collectives if c.kind == "all-gather" and c.count == n_layers]
    assert len(loops) == 2 and all(c.payload_bytes == one_layer for c in loops)
    rows = {line[:16].strip(): line[16:36].split() for line in step.summary(state, batches[0]).splitlines()[1:-1]}
    assert rows[group] == [str(n_layers), "per", "layer"]


def test_stacked_model_matches_one_device_and_gathers_per_layer(mesh):
    check_scanned_stack(mesh, Stacked, "blocks")


def test_plain_nnx_scan_gathers_the_whole_stack_and_says_so(mesh):
    cfg = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=128)
    batches = [_stacked_batch(0)]
    model = Stacked(nnx.Rngs(0), scan=nnx.scan)
    with pytest.warns(UserWarning, match=r"\['blocks'\] are gathered whole"):
        losses, state, step, compiled = _sharded(model, mse, batches, mesh, cfg, 1e-2)
    np.testing.assert_allclose(losses, _reference(Stacked(nnx.Rngs(0)), mse, batches, 1e-2), rtol=1e-5)
    text = step.summary(state, batches[0])
    per_layer = 4 * state.layout.group("blocks").flat_size
    assert f"whole stack: {3 * per_layer / 2**20:.3f} MiB instead of {per_layer / 2**20:.3f} MiB" in text


def _dropout_run(mesh, steps=2, resume=False):
    cfg = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=128)
    model = Stacked(nnx.Rngs(0, dropout=1), dropout=0.5)
    model.top = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=2))

    def loss_fn(m, b):
        masks = m.top(jnp.ones((b["x"].shape[0], 64))) > 0  # this device's mask, per example
        return mse(m, b), masks

    opt = q.optim.qsdp(optax.sgd(1e-2), cfg)
    state = qnnx.init_state(model, opt, mesh, cfg)
    step = qnnx.make_train_step(model, loss_fn, opt, mesh, cfg, has_aux=True)
    x = jnp.broadcast_to(_stacked_batch(0)["x"][:1], (16, 4))  # the same example everywhere
    out = []
    for _ in range(steps):
        if resume:  # as restored from a checkpoint: every array through the host
            state = jax.tree.map(lambda a: jax.device_put(np.asarray(a), a.sharding), state)
        state, metrics, masks = step(state, {"x": x, "y": jnp.zeros(16)})
        out.append((float(metrics["loss"]), np.asarray(masks).reshape(N, 2, 64)))
    return out


def test_dropout_differs_by_device_and_step_and_repeats_on_rerun(mesh):
    run = _dropout_run(mesh)
    masks0, masks1 = run[0][1], run[1][1]
    assert len({m.tobytes() for m in masks0[:, 0]}) == N  # each device its own mask
    assert not np.array_equal(masks0, masks1)  # and a new one each step
    again = _dropout_run(mesh, resume=True)  # a rerun, resumed after every step
    for (l_a, m_a), (l_b, m_b) in zip(run, again):
        assert l_a == l_b and np.array_equal(m_a, m_b)  # a pure function of (seed, step, device)


class BNNet(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 8, use_bias=False, rngs=rngs)  # a bias before BN has no gradient
        self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))  # a counter: carried, not averaged

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        return self.out(jax.nn.relu(self.bn(self.lin(x))))[:, 0]


def test_batchnorm_statistics_match_one_device(mesh):
    cfg = q.QSDPConfig.fp32(**SMALL)
    batches = [
        {"x": 3.0 + _stacked_batch(i)["x"] * (1 + jnp.arange(16.0))[:, None], "y": _stacked_batch(i)["y"]}
        for i in range(3)
    ]
    model = BNNet(nnx.Rngs(0))
    losses, state, *_ = _sharded(model, mse, batches, mesh, cfg, 1e-2)
    ref = BNNet(nnx.Rngs(0))
    np.testing.assert_allclose(losses, _reference(ref, mse, batches, 1e-2), rtol=1e-5)
    assert set(state.model_state) == {"bn/mean", "bn/var", "calls"}
    assert int(state.model_state["calls"]) == 3 == int(ref.calls[...])
    qnnx.update(model, state)
    stats = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.BatchStat))  # noqa: E731
    chex.assert_trees_all_close(stats(model), stats(ref), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(stats(ref)["bn"]["mean"]).max()) > 0.1  # the statistics moved


class Empty(nnx.Module):
    def __init__(self):
        self.count = nnx.Variable(jnp.zeros(()))


def test_clear_errors(mesh):
    cfg = q.QSDPConfig.fp32(**SMALL)
    opt = q.optim.qsdp(optax.sgd(1e-2), cfg)
    with pytest.raises(ValueError, match="Empty has no nnx.Param"):
        qnnx.init_state(Empty(), opt, mesh, cfg)
    model = ListMLP(nnx.Rngs(0))
    state = qnnx.init_state(model, opt, mesh, cfg)
    per_example = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2, axis=1)  # noqa: E731
    step = qnnx.make_train_step(model, per_example, opt, mesh, cfg, donate=False)
    with pytest.raises(ValueError, match=r"scalar floating loss.*shape \(2,\)"):
        step(state, _mlp_batch(0))

    def scans_a_linear(m, b):
        f = qnnx.scan(lambda x, lin: lin(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        return jnp.mean(f(b["x"], m.proj))

    with pytest.raises(ValueError, match=r"argument 1 \(Linear\).*not a layer stack"):
        scans_a_linear(model, _mlp_batch(0))  # outside the step
    step = qnnx.make_train_step(model, scans_a_linear, opt, mesh, cfg, donate=False)
    with pytest.raises(ValueError, match=r"argument 1 \(Linear\).*not a layer stack"):
        step(state, _mlp_batch(0))  # inside it


@pytest.mark.parametrize("platform", ["tpu", "cuda"], ids=["export-tpu", "export-cuda"])
def test_the_step_lowers_for_accelerators(mesh, platform):
    """The NNX step (QSDP W8G8, drop-in scan, dropout) exports for hardware we do not have."""
    cfg = q.QSDPConfig.qsdp(8, 8, bucket_size=64, min_shard_size=128)
    model = Stacked(nnx.Rngs(0), dropout=0.1)
    opt = q.optim.qsdp(optax.adam(1e-3), cfg)
    state = jax.eval_shape(lambda: qnnx.init_state(model, opt, mesh, cfg))
    step = qnnx.make_train_step(model, mse, opt, mesh, cfg)
    # jax.export takes a jax.stages.Wrapped from jax 0.11, a protocol Python 3.12 checks
    # statically (a method reached through __getattr__ does not count)
    assert all(inspect.getattr_static(step, m, None) is not None for m in ("__call__", "trace", "lower"))
    exported = jax.export.export(step, platforms=[platform])(state, _stacked_batch(0))
    assert exported.platforms == (platform,) and "all_gather" in exported.mlir_module()
