"""prefetch_scan (the layer loops of a TPU step: the next layer gathered while this one
computes) against remat_scan of the same layer: the same values and gradients, with sharded
gathers and their reduce-scatters, closures, stacked or apart blocks; and in the loops each
gather is of the next layer, nothing of this iteration waiting for it."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import qsdp_jax as q
import toymodel
from qsdp_jax import optim
from qsdp_jax._src.step.layer_scan import remat_scan
from qsdp_jax._src.step.prefetch_scan import prefetch_scan

L, D, N = 5, 16, 8


def _gather(scale):
    """A layer's weights from this device's row block: a tiled all-gather (its gradient a
    psum_scatter), times a per-layer constant and a closed-over ``scale``."""

    def gather(blocks, k):
        w, b = blocks
        return lax.all_gather(w, "x", tiled=True) * k + scale, b

    return gather


def _body(c, weights, x, k):
    w, b = weights
    h = jnp.tanh(c @ w + b + (0 if x is None else x))
    return h, jnp.sum(h**2, axis=-1) * k


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(L, D, D)).astype(np.float32) / 4)
    b = jnp.asarray(rng.normal(size=(L, D)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(L, 2, D)).astype(np.float32))
    k = jnp.asarray(rng.uniform(0.5, 1.5, size=(L,)).astype(np.float32))
    h0 = jnp.asarray(rng.normal(size=(2, D)).astype(np.float32))
    return w, b, x, k, h0


def _loss(mesh, scan, apart, with_x):
    def local(w, b, x, k, h0):
        scale = jnp.sum(h0) * 1e-2  # a closed-over value with a gradient
        blocks = [(w[i], b[i]) for i in range(L)] if apart else (w, b)
        xs = x if with_x else None
        if scan == "prefetch":
            h, ys = prefetch_scan(_gather(scale), _body, h0, blocks, xs, k, apart=apart)
        else:
            gather = _gather(scale)

            def layer(c, d, kk):  # remat_scan's layer: the gather inside it
                bl, xl = (d, None) if apart else d
                return _body(c, gather(bl, kk), xl, kk)

            h, ys = remat_scan(layer, h0, blocks if apart else (blocks, xs), k, apart=apart)
        return lax.psum(jnp.sum(h) + 0.1 * jnp.sum(ys * jnp.arange(1, L + 1)[:, None]), "x")

    specs = (P(None, "x"), P(), P(), P(), P())
    fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 4)))


@pytest.mark.parametrize("apart, with_x", [(False, True), (False, False), (True, False)])
def test_values_and_gradients_are_the_remat_scans(apart, with_x):
    mesh = jax.make_mesh((N,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    w, b, x, k, h0 = _inputs()
    v1, g1 = _loss(mesh, "prefetch", apart, with_x)(w, b, x, k, h0)
    v2, g2 = _loss(mesh, "remat", apart, with_x)(w, b, x, k, h0)
    np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), rtol=1e-6)
    chex.assert_trees_all_close(g1, g2, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g1[3]).sum()) > 0  # the closure's gradient reached h0


def _loop_collectives(hlo: str) -> list[list[str]]:
    """The collectives of each while body of the compiled text (kinds, in order)."""
    from qsdp_jax._src.hlo.reader import _attr_value, parse_module

    module = parse_module(hlo)
    bodies = {
        (_attr_value(i.attrs, "body") or "").lstrip("%")
        for instrs in module.computations.values()
        for i in instrs
        if i.opcode == "while"
    }
    kinds = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")
    return [[i.opcode for i in module.computations[b] if i.opcode.startswith(kinds)] for b in sorted(bodies) if b]


def test_each_loop_has_one_gather_and_the_backward_one_scatter():
    """The forward loop gathers once an iteration (the next layer), the backward gathers once
    (the previous layer) and reduce-scatters once (the next layer's gradient): no gather is
    repeated inside an iteration for the VJP."""
    mesh = jax.make_mesh((N,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    w, b, x, k, h0 = _inputs()
    hlo = _loss(mesh, "prefetch", False, True).lower(w, b, x, k, h0).compile().as_text()
    loops = sorted(_loop_collectives(hlo), key=len)
    assert len(loops) == 2, loops
    fwd, bwd = loops
    assert fwd == ["all-gather"], fwd
    assert sorted(bwd) == ["all-gather", "reduce-scatter"], bwd


@pytest.mark.parametrize(
    "name, extra",
    [
        ("fp32", {}),
        ("qsdp-W8G8", {}),
        ("qsdp-W8G8", {"weight_storage": "codes"}),
        ("qsdp-W4G4", {"node_axis": "node", "axis_name": "local"}),
    ],
    ids=["fp32", "W8G8", "W8G8-codes", "W4G4-two-level"],
)
def test_the_train_step_is_the_same_with_the_layers_prefetched(monkeypatch, name, extra):
    """The whole step with the prefetching loops (forced on CPU) gives the losses and weights
    of the step without, over 3 steps (the same gathers, keys and reduce-scatters): float32,
    quantized, code-held weights and the two-level collectives."""
    import dataclasses

    import optax

    from qsdp_jax._src.collective import overlap

    mesh = q.make_mesh({"node": 2, "local": 4}) if "node_axis" in extra else q.make_mesh()
    config = dataclasses.replace(q.QSDPConfig.from_name(name), **extra)
    assert overlap.prefetch_layers(mesh, True) is None  # CPU: off unless forced

    def run(prefetch):
        monkeypatch.setattr(q.train, "prefetch_layers", lambda mesh, overlap: prefetch)
        opt = optim.qsdp(optax.adam(1e-2), config)
        state = q.init_train_state(toymodel.init(0), opt, mesh, config, stacked=toymodel.STACKED)
        step = q.make_train_step(toymodel.loss, opt, mesh, config, donate=False)
        losses = []
        for i in range(3):
            state, metrics = step(state, toymodel.batch(i))
            losses.append(float(metrics["loss"]))
        return losses, state.params

    (l0, p0) = run(None)
    for a2a in (False, True):  # a float32 reduce-scatter as psum_scatter, or all_to_all + sum
        l1, p1 = run(overlap.Prefetch(scatter_by_all_to_all=a2a))
        np.testing.assert_allclose(l1, l0, rtol=1e-6)
        chex.assert_trees_all_close(p1, p0, rtol=1e-5, atol=1e-6)
