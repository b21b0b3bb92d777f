"""The sharded train step: FSDP with quantized collectives, per-layer gathers, shard updates.

Usage::

    mesh = qsdp_jax.make_mesh()
    config = qsdp_jax.QSDPConfig.qsdp(weight_bits=8, grad_bits=8)
    opt = qsdp_jax.optim.qsdp(optax.adam(1e-3), config)
    state = qsdp_jax.init_train_state(params, opt, mesh, config, stacked=("blocks",))
    step = qsdp_jax.make_train_step(loss_fn, opt, mesh, config)
    state, metrics = step(state, batch)

``loss_fn(p: ParamAccess, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux=True``) reads
its parameters through ``p.gather(group)`` / ``p.scan(group, body, carry)``
(``qsdp_jax.access``). Inside the step, which is one ``jax.shard_map`` over the mesh:

1. each device takes its slice of the batch (the global batch must divide over the devices);
2. ``gather`` all-gathers a group's flat buffer (quantized per the config; lossless in
   ``"qsdp"`` mode), ``scan`` does the same one layer at a time inside ``lax.scan`` and
   rematerialises the layer in the backward pass, so peak memory holds one layer's weights;
3. the backward pass of each gather reduce-scatters that buffer's gradient (quantized), so each
   device receives the summed gradient of its own shard; replicated small leaves are averaged
   with ``pmean``;
4. the optimizer updates the local shards; in ``"qsdp"`` mode the new weights are snapped
   exactly onto the new grid held in the optimizer state;
5. if any gradient is non-finite on any device, weights and optimizer state are left as they
   were and ``metrics["nonfinite"]`` is 1.

Gradient-quantization keys are ``derive_key(seed, GRAD, step, group, layer)`` folded with the
sender's index: the backward re-gather and every resumed run see the same randomness.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from qsdp_jax import optim as qoptim
from qsdp_jax import quantizers as qz
from qsdp_jax.collectives import make_gather
from qsdp_jax.config import QSDPConfig
from qsdp_jax.guards import CheckedStep, check_params, warn_padding
from qsdp_jax.hierarchy import device_mean, gather_spec, mesh_sizes
from qsdp_jax.sharding import Buffer, FlatLayout

PyTree = Any
PURPOSE_GRAD = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Sharded training state.

    Attributes:
      step: int32 scalar, replicated; counts every step, skipped (non-finite) ones included.
      params: ``{"sharded": {group: flat buffer}, "replicated": {group: tuple of leaves}}``
        (see ``qsdp_jax.sharding.FlatLayout``); flat buffers are sharded over the FSDP axis.
      opt_state: the optimizer state of each device's local params, stacked on a leading device
        axis sharded over the FSDP axis (so any optax state shards without extra rules).
      layout: static; maps ``params`` back to the model's pytree.
      model_state: the non-parameter state of a Flax NNX model (``qsdp_jax.nnx``): batch
        statistics, counters, RNG keys as ``{"path/to/var": array}``, replicated; ``None``
        for the ``ParamAccess`` API.
    """

    step: jax.Array
    params: dict
    opt_state: PyTree
    layout: FlatLayout = dataclasses.field(metadata=dict(static=True))
    model_state: PyTree = None


class ShardedParams:
    """:class:`qsdp_jax.access.ParamAccess` inside the train step (see the module docstring)."""

    def __init__(self, layout: FlatLayout, params: dict, grid, step, config: QSDPConfig):
        self._layout = layout
        self._params = params
        self._grid = grid  # (scales, offsets) trees over params["sharded"], or None
        self._step = step
        self._config = config
        self._gather = make_gather(gather_spec(config))

    def _key(self, group: str, layer, buffer: Buffer) -> jax.Array:
        gi = self._layout.group_index(group)
        if buffer.index == 0:
            return qz.derive_key(self._config.seed, PURPOSE_GRAD, self._step, gi, layer)
        return qz.derive_key(self._config.seed, PURPOSE_GRAD, self._step, gi, layer, buffer.index)

    def _gather_buffer(self, buffer: Buffer, shard, grid, key):
        """One buffer's gather (its gradient's reduce-scatter in the backward), at its bits."""
        if buffer.bits is None:
            return self._gather(shard, grid, key)
        return make_gather(gather_spec(self._config.buffer_config(*buffer.bits)))(shard, grid, key)

    def _grid_of(self, buffer: Buffer):
        """(scales, offsets) of a buffer's local shard: (n_buckets,) or (n_layers, n_buckets);
        None without a grid (not ``"qsdp"`` mode, or a policy's full-precision buffer)."""
        if self._grid is None or buffer.resolved_bits(self._config)[0] is None:
            return None
        scales, offsets = self._grid[0][buffer.key], self._grid[1][buffer.key]
        if not buffer.stacked:  # the optimizer keeps 2-D rows: (1, n_buckets)
            scales, offsets = scales.reshape(-1), offsets.reshape(-1)
        return scales, offsets

    def gather(self, group: str) -> PyTree:
        g = self._layout.group(group)
        if g.stacked:
            raise ValueError(f"group {group!r} is layer-stacked: read it with scan(), not gather()")
        flat = {
            b.key: self._gather_buffer(b, self._params["sharded"][b.key], self._grid_of(b), self._key(group, 0, b))
            for b in g.buffers
        }
        return self._layout.unflatten_group(group, flat, self._params["replicated"][group])

    def scan(self, group, body, init, xs=None, *, remat=True):
        g = self._layout.group(group)
        if not g.stacked:
            raise ValueError(f"group {group!r} is not layer-stacked: read it with gather(), not scan()")
        buffers = g.buffers
        shards = {b.key: self._params["sharded"][b.key] for b in buffers}
        grid = {b.key: self._grid_of(b) for b in buffers}

        def layer(carry, inputs):
            shard, grid_l, replicated, index, x = inputs
            flat = {b.key: self._gather_buffer(b, shard[b.key], grid_l[b.key], self._key(group, index, b))
                    for b in buffers}
            return body(carry, self._layout.unflatten_group(group, flat, replicated), x)

        if remat:
            layer = jax.checkpoint(layer, prevent_cse=False)
        indices = jnp.arange(g.n_layers, dtype=jnp.int32)
        return lax.scan(layer, init, (shards, grid, self._params["replicated"][group], indices, xs))


# ----------------------------------------------------------------------------------------------
# Helpers shared by init and step
# ----------------------------------------------------------------------------------------------
def _sharded_mask(params: dict) -> dict:
    return {
        "sharded": jax.tree.map(lambda _: True, params["sharded"]),
        "replicated": jax.tree.map(lambda _: False, params["replicated"]),
    }


def _context(axis, n: int, params: dict, layout: FlatLayout, config: QSDPConfig):
    """The optimizer's sharding context; with a bit policy, each leaf's weight bits too."""
    bits = None
    if config.bit_policy:
        by_key = {b.key: b.resolved_bits(config)[0] for b in layout.buffers}
        bits = tuple(
            by_key[path[1].key] if path[0].key == "sharded" else None
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
        )
    return qoptim.sharding_context(axis, n, _sharded_mask(params), bits)


def _grid_for_step(opt_state, config: QSDPConfig, layout: FlatLayout):
    if config.weight_mode != "qsdp":
        return None
    st = qoptim.find_qsdp_state(opt_state)
    if st is None:
        raise ValueError(
            "weight_mode='qsdp' needs the optimizer wrapped with qsdp_jax.optim.qsdp(base, config)"
        )
    if st.bits != config.weight_bits or st.bucket != config.bucket_size:
        raise ValueError(
            f"the optimizer was built for weight_bits={st.bits}, bucket_size={st.bucket}, but the "
            f"train step's config has weight_bits={config.weight_bits}, "
            f"bucket_size={config.bucket_size}: build both from the same QSDPConfig"
        )
    return st.scales["sharded"], st.offsets["sharded"]


def _check_config(config):
    if not isinstance(config, QSDPConfig):
        raise TypeError(f"config must be a QSDPConfig, got {type(config).__name__}")


def init_train_state(
    params: dict[str, PyTree],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    config: QSDPConfig,
    *,
    stacked: Sequence[str] = (),
) -> TrainState:
    """Shard ``params`` over the mesh, initialise the optimizer on each device's shards and, in
    ``"qsdp"`` mode, project the weights onto their initial grid.

    Args:
      params: a dict of groups (see ``qsdp_jax.access``).
      stacked: the groups whose leaves carry a leading layer axis (read with ``scan``).
    """
    check_params(params, stacked)
    layout = _layout(params, mesh, config, stacked)
    flatten = jax.jit(layout.flatten, out_shardings=layout.shardings(mesh, config.shard_axes))
    p, opt_state = _init_fn(layout, optimizer, mesh, config)(flatten(params))
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    return TrainState(step=step, params=p, opt_state=opt_state, layout=layout)


def abstract_train_state(
    params: dict[str, PyTree],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    config: QSDPConfig,
    *,
    stacked: Sequence[str] = (),
) -> TrainState:
    """A TrainState of ``jax.ShapeDtypeStruct`` (with shardings), allocating nothing.

    ``params`` may itself be abstract (e.g. ``jax.eval_shape`` of an initialiser). Use it to
    compile a step for a model too large for this machine:
    ``make_train_step(...).lower(abstract_state, abstract_batch).compile()``.
    """
    layout = _layout(params, mesh, config, stacked)
    flat = jax.eval_shape(layout.flatten, params)
    p, opt_state = jax.eval_shape(_init_fn(layout, optimizer, mesh, config), flat)
    with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    p = jax.tree.map(with_sharding, p, layout.shardings(mesh, config.shard_axes))
    stacked_sharding = NamedSharding(mesh, P(config.shard_axes))
    opt_state = jax.tree.map(lambda x: with_sharding(x, stacked_sharding), opt_state)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    return TrainState(step=step, params=p, opt_state=opt_state, layout=layout)


def _layout(params, mesh: Mesh, config: QSDPConfig, stacked: Sequence[str]) -> FlatLayout:
    _check_config(config)
    if isinstance(stacked, str):
        check_params({}, stacked)
    n, _ = mesh_sizes(mesh, config)
    layout = FlatLayout.create(params, n, config.bucket_size, config.min_shard_size, stacked,
                               config.bit_policy, (config.weight_bits, config.grad_bits))
    warn_padding(layout, config)
    return layout


def _init_fn(layout: FlatLayout, optimizer, mesh: Mesh, config: QSDPConfig):
    """Jitted ``flat params -> (params, device-stacked opt_state)``: optimizer init on each
    device's shards and, in ``"qsdp"`` mode, the projection onto the initial grid."""
    axis, n = config.shard_axes, mesh_sizes(mesh, config)[0]
    specs = layout.specs(axis)

    def local_init(p):
        with _context(axis, n, p, layout, config):
            opt_state = optimizer.init(p)
            qoptim.check_same_config(opt_state, config)  # also refuses two QSDPStates
            if config.weight_mode == "qsdp":
                _grid_for_step(opt_state, config, layout)  # clear error if not wrapped
                p = qoptim.snap_to_grid(p, opt_state, config)
        return p, jax.tree.map(lambda x: jnp.asarray(x)[None], opt_state)

    # P(axis) is a prefix for the whole opt_state: every leaf gets a leading device axis.
    return jax.jit(
        jax.shard_map(local_init, mesh=mesh, in_specs=(specs,), out_specs=(specs, P(axis)), check_vma=False)
    )


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    config: QSDPConfig,
    *,
    has_aux: bool = False,
    aux_out_spec: Any = None,
    donate: bool = True,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
    """A jitted ``step(state, batch) -> (state, metrics)`` (see the module docstring).

    Args:
      loss_fn: ``loss_fn(p, batch)`` with ``p`` a ``ParamAccess``; returns the mean loss over the
        local batch (or ``(loss, aux)`` with ``has_aux``).
      optimizer: the optimizer the state was initialised with (``qsdp(...)``-wrapped in
        ``"qsdp"`` mode).
      aux_out_spec: out_specs for ``aux`` (default ``P(axis)``: per-device values concatenated
        on their leading axis; give ``jax.P()`` for values that are the same everywhere).
      donate: donate the input state's buffers to the output.

    Metrics: ``loss`` (global mean), ``grad_norm`` (global, of the averaged gradient),
    ``nonfinite`` (1 when the update was skipped), ``step`` (the step that was taken).
    """
    _check_config(config)
    n, n_dev = mesh_sizes(mesh, config)
    axis, batch_axes = config.shard_axes, config.batch_axes

    def local_step(step, params, opt_state, batch, layout):
        opt_state = jax.tree.map(lambda x: x[0], opt_state)
        qoptim.check_same_config(opt_state, config)
        grid = _grid_for_step(opt_state, config, layout)

        def objective(p):
            out = loss_fn(ShardedParams(layout, p, grid, step, config), batch)
            return out if has_aux else (out, None)

        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
        grads = {
            "sharded": jax.tree.map(lambda g: g / n_dev, grads["sharded"]),
            "replicated": jax.tree.map(lambda g: device_mean(g, config), grads["replicated"]),
        }
        with _context(axis, n, params, layout, config):
            finite = qoptim.all_finite(grads)
            updates, new_opt = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            if config.weight_mode == "qsdp":
                new_params = qoptim.snap_to_grid(new_params, new_opt, config)
            # the new weights too: an update can overflow (e.g. float16 leaves) on finite grads
            finite = finite & qoptim.all_finite(new_params)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        new_params = jax.tree.map(keep, new_params, params)
        new_opt = jax.tree.map(keep, new_opt, opt_state)
        sq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads["sharded"]))
        sq = lax.psum(jnp.asarray(sq, jnp.float32), axis)
        sq = sq + sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads["replicated"]))
        metrics = {
            "loss": lax.pmean(loss, batch_axes),
            "grad_norm": jnp.sqrt(sq),
            "nonfinite": (~finite).astype(jnp.int32),
            "step": step,
        }
        new_opt = jax.tree.map(lambda x: x[None], new_opt)
        return step + 1, new_params, new_opt, metrics, aux

    def step_fn(state: TrainState, batch):
        _check_batch(batch, n_dev)
        layout = state.layout
        specs = layout.specs(axis)
        opt_specs = P(axis)  # a prefix: every opt_state leaf has a leading device axis
        batch_specs = jax.tree.map(lambda _: P(batch_axes), batch)
        aux_spec = P(batch_axes) if aux_out_spec is None else aux_out_spec
        body = jax.shard_map(
            lambda s, p, o, b: local_step(s, p, o, b, layout),
            mesh=mesh,
            in_specs=(P(), specs, opt_specs, batch_specs),
            out_specs=(P(), specs, opt_specs, P(), aux_spec if has_aux else P()),
            check_vma=False,
        )
        step, params, opt_state, metrics, aux = body(state.step, state.params, state.opt_state, batch)
        new_state = TrainState(step=step, params=params, opt_state=opt_state, layout=layout)
        return (new_state, metrics, aux) if has_aux else (new_state, metrics)

    return CheckedStep(jax.jit(step_fn, donate_argnums=(0,) if donate else ()))


def make_eval_step(
    loss_fn: Callable[..., Any], mesh: Mesh, config: QSDPConfig
) -> Callable[[TrainState, PyTree], jax.Array]:
    """A jitted ``eval(state, batch) -> mean loss`` with the same gathers as training (lossless
    in ``"qsdp"`` mode: evaluation sees exactly the weights training uses)."""
    _check_config(config)
    n, n_dev = mesh_sizes(mesh, config)
    axis, batch_axes = config.shard_axes, config.batch_axes

    def local_eval(step, params, opt_state, batch, layout):
        opt_state = jax.tree.map(lambda x: x[0], opt_state)
        grid = _grid_for_step(opt_state, config, layout)
        loss = loss_fn(ShardedParams(layout, params, grid, step, config), batch)
        return lax.pmean(loss, batch_axes)

    def eval_fn(state: TrainState, batch):
        _check_batch(batch, n_dev)
        layout = state.layout
        body = jax.shard_map(
            lambda s, p, o, b: local_eval(s, p, o, b, layout),
            mesh=mesh,
            in_specs=(P(), layout.specs(axis), P(axis),
                      jax.tree.map(lambda _: P(batch_axes), batch)),
            out_specs=P(),
            check_vma=False,
        )
        return body(state.step, state.params, state.opt_state, batch)

    return CheckedStep(jax.jit(eval_fn))


def _check_batch(batch, n: int):
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("the batch is empty")
    sizes = {x.shape[0] for x in leaves if x.ndim}
    if len(sizes) > 1:
        raise ValueError(
            f"batch leaves have different leading (batch) sizes {sorted(sizes)}: every leaf must "
            "hold the same examples"
        )
    for x in leaves:
        if x.ndim == 0:
            raise ValueError("every batch leaf needs a leading batch axis; got a scalar")
        if x.shape[0] % n:
            raise ValueError(
                f"the global batch of {x.shape[0]} examples does not divide over {n} devices: "
                f"use a multiple of {n}"
            )


def gather_params(state: TrainState) -> dict[str, PyTree]:
    """The full parameter pytree (the optimizer's values) from a TrainState, as global arrays."""
    return state.layout.unflatten(state.params)
