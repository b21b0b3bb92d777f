"""The sharded train step: FSDP with quantized collectives, per-layer gathers, a global optimizer.

Usage::

    mesh = qsdp_jax.make_mesh()
    config = qsdp_jax.QSDPConfig.qsdp(weight_bits=8, grad_bits=8)
    opt = qsdp_jax.optim.qsdp(optax.adam(1e-3), config)
    state = qsdp_jax.init_train_state(params, opt, mesh, config, stacked=("blocks",))
    step = qsdp_jax.make_train_step(loss_fn, opt, mesh, config)
    state, metrics = step(state, batch)

``state.params`` is the model's own pytree of global arrays, each leaf sharded over the FSDP
axis by the rule of :mod:`qsdp_jax.layout` (with ``QSDPConfig(weight_storage="codes")`` a gridded
leaf is held as its packed codes, :mod:`qsdp_jax._src.quant.weight_codes`; :func:`gather_params`
decodes); the optimizer state is sharded like its params
(:mod:`qsdp_jax._src.layout.state_specs`). ``loss_fn(p: ParamAccess, batch) -> loss`` (or ``(loss, aux)``
with ``has_aux=True``) reads its parameters through ``p.gather(group)`` / ``p.scan(group, body,
carry)`` (``qsdp_jax.access``). One step:

1. **forward and backward in one ``jax.shard_map``**: each device takes its slice of the batch;
   ``gather`` packs a group's local blocks into one buffer and all-gathers it (quantized per
   the config; lossless in ``"qsdp"`` mode), ``scan`` does so one layer at a time inside
   ``lax.scan`` and rematerialises the layer in the backward pass; the backward of each gather
   reduce-scatters that buffer's gradient (quantized), so each device receives the summed
   gradient of its own blocks; replicated small leaves' gradients are averaged
   (:mod:`qsdp_jax._src.step.sharded_access`);
2. **the optimizer in the global view**, outside the ``shard_map``: any optax transformation
   computes what it computes on one device; in ``"qsdp"`` mode ``qsdp_jax.optim.qsdp`` projects
   the new weights onto fresh grids per device block, and they are snapped exactly onto them;
3. if any gradient or new weight is non-finite, weights and optimizer state are left as they
   were and ``metrics["nonfinite"]`` is 1.
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
from qsdp_jax.config import QSDPConfig, check_config
from qsdp_jax._src.quant.grid import layout_context
from qsdp_jax._src.step.guards import CheckedStep, check_batch, check_params, check_stacked, warn_padding
from qsdp_jax._src.collective.hierarchy import mesh_sizes
from qsdp_jax._src.collective.overlap import compiler_options, prefetch_layers
from qsdp_jax._src.step.sharded_access import ShardedParams  # noqa: F401  (re-exported)
from qsdp_jax._src.step.body import grid_for_step, local_grads, local_loss, sharded_body
from qsdp_jax.layout import ParamLayout
from qsdp_jax._src.layout.state_specs import opt_state_shardings, opt_state_specs
from qsdp_jax._src.quant import weight_codes as wc

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Sharded training state.

    Attributes:
      step: int32 scalar, replicated; counts every step, skipped (non-finite) ones included.
      params: the model's params dict of groups, global arrays, each leaf sharded per
        ``layout`` (``qsdp_jax.layout``): what a plain loop would hold, spread over devices.
      opt_state: the optimizer's state of those params, global arrays sharded like them.
      layout: static; how each leaf is sharded and packed for the collectives.
      model_state: the non-parameter state of a Flax NNX model (``qsdp_jax.nnx``): batch
        statistics, counters, RNG keys as ``{"path/to/var": array}``, replicated; ``None``
        for the ``ParamAccess`` API.
    """

    step: jax.Array
    params: dict
    opt_state: PyTree
    layout: ParamLayout = dataclasses.field(metadata=dict(static=True))
    model_state: PyTree = None


def init_train_state(
    params: dict[str, PyTree],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    config: QSDPConfig,
    *,
    stacked: Sequence[str] = (),
) -> TrainState:
    """Shard ``params`` over the mesh, initialise the optimizer on them (global view) and, in
    ``"qsdp"`` mode, put the weights on their initial grid.

    Args:
      params: a dict of groups (see ``qsdp_jax.access``); every leaf floating point and finite.
      optimizer: any optax transformation (``qsdp_jax.optim.qsdp``-wrapped in ``"qsdp"`` mode).
      mesh: the mesh (``qsdp_jax.make_mesh``), with the config's axes (``config.mesh_axes``).
      config: the run's config.
      stacked: the groups whose leaves carry a leading layer axis (read with ``scan``); a
        sequence of group names, default none.

    Returns:
      The sharded :class:`TrainState` at step 0.

    Raises:
      TypeError: ``config`` is not a :class:`QSDPConfig`, ``mesh`` not a ``Mesh``, ``stacked``
        a string, or a leaf of ``params`` not floating point.
      ValueError: a leaf holds NaN or Inf; the mesh's axes do not match the config's; the
        layout cannot be built (see :meth:`ParamLayout.create`); in ``"qsdp"`` mode the
        optimizer is not wrapped with ``qsdp_jax.optim.qsdp`` (or wrapped twice) or was built
        from another config.
    """
    check_params(params, stacked)
    return init_checked_state(params, optimizer, mesh, config, stacked)


def init_checked_state(params, optimizer, mesh: Mesh, config: QSDPConfig, stacked: Sequence[str]) -> TrainState:
    """:func:`init_train_state` for params a front door has checked already (the NNX one,
    with its own words), so the NaN scan over every parameter runs once."""
    layout = _layout(params, mesh, config, stacked)
    shard = jax.jit(lambda p: jax.tree.map(jnp.asarray, p), out_shardings=layout.shardings(mesh, config.shard_axes))
    p = shard(params)
    init = _init_fn(layout, optimizer, mesh, config)
    abstract = jax.eval_shape(init, p)
    out = (
        _storage_shardings(layout, mesh, config),
        opt_state_shardings(abstract[1], p, layout, mesh, config.shard_axes),
    )
    p, opt_state = jax.jit(init, out_shardings=out)(p)
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
    ``make_train_step(...).lower(abstract_state, abstract_batch).compile()``. Unlike
    :func:`init_train_state` it does not look at the values (no NaN check).

    Args:
      params: a dict of groups, concrete or abstract arrays.
      optimizer: as for :func:`init_train_state`.
      mesh: the mesh the state would live on.
      config: the run's config.
      stacked: the groups whose leaves carry a leading layer axis.

    Returns:
      The :class:`TrainState` :func:`init_train_state` would return, with
      ``jax.ShapeDtypeStruct`` leaves carrying their shardings (the layout is the real one).

    Raises:
      TypeError: ``config`` is not a :class:`QSDPConfig`, ``mesh`` not a ``Mesh``, or
        ``stacked`` a string.
      ValueError: as for :func:`init_train_state` (mesh, layout, optimizer), NaN aside.
    """
    layout = _layout(params, mesh, config, stacked)
    shardings = layout.shardings(mesh, config.shard_axes)
    with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    p = jax.tree.map(with_sharding, jax.eval_shape(lambda x: x, params), shardings)
    stored, opt_state = jax.eval_shape(_init_fn(layout, optimizer, mesh, config), p)
    opt_state = jax.tree.map(
        with_sharding, opt_state, opt_state_shardings(opt_state, p, layout, mesh, config.shard_axes)
    )
    p = jax.tree.map(with_sharding, stored, _storage_shardings(layout, mesh, config))
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    # an abstract state: the TrainState pytree with ShapeDtypeStruct leaves (what jax.eval_shape
    # gives), which the field types, written for concrete states, do not cover
    return TrainState(step=step, params=p, opt_state=opt_state, layout=layout)  # type: ignore[arg-type]


def _layout(params, mesh: Mesh, config: QSDPConfig, stacked: Sequence[str]) -> ParamLayout:
    check_config(config)
    check_stacked(stacked)
    n, _ = mesh_sizes(mesh, config)
    layout = ParamLayout.create(
        params,
        n,
        config.bucket_size,
        config.min_shard_size,
        stacked,
        config.bit_policy,
        (config.weight_bits, config.grad_bits),
    )
    warn_padding(layout, config)
    return layout


def _init_fn(layout: ParamLayout, optimizer, mesh: Mesh, config: QSDPConfig):
    """``params -> (params, opt_state)``: optimizer init in the global view and, in ``"qsdp"``
    mode, the weights snapped onto the initial grid."""

    def init(p):
        with layout_context(layout, mesh, config.shard_axes):
            opt_state = optimizer.init(p)
            qoptim.check_same_config(opt_state, config)  # also refuses two QSDPStates
            if config.weight_mode == "qsdp":
                grid_for_step(opt_state, config)  # clear error if not wrapped
                p = qoptim.snap_to_grid(p, opt_state, config)
                p = wc.encode(p, opt_state, config, layout)  # as it is unless code-held
        return p, opt_state

    return init


def _storage_shardings(layout: ParamLayout, mesh: Mesh, config: QSDPConfig):
    """The shardings of ``TrainState.params``: the leaves', or the grids' for code-held leaves."""
    specs = wc.storage_specs(layout, config)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    config: QSDPConfig,
    *,
    has_aux: bool = False,
    aux_out_spec: Any = None,
    donate: bool = True,
    overlap: bool = True,
) -> Callable[[TrainState, PyTree], tuple[Any, ...]]:
    """A jitted ``step(state, batch) -> (state, metrics)`` (see the module docstring), or
    ``-> (state, metrics, aux)`` with ``has_aux``.

    Args:
      loss_fn: ``loss_fn(p, batch)`` with ``p`` a ``ParamAccess``; returns the mean loss over the
        local batch, or a :class:`~qsdp_jax.WeightedMean` ``(total, weight)`` for a loss
        normalised by a count of its batch (the step trains the global ratio), or either as
        ``(loss, aux)`` with ``has_aux``.
      optimizer: the optimizer the state was initialised with (``qsdp(...)``-wrapped in
        ``"qsdp"`` mode).
      mesh: the state's mesh.
      config: the run's config.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      aux_out_spec: out_specs for ``aux`` (default ``P(axis)``: per-device values concatenated
        on their leading axis; give ``jax.P()`` for values that are the same everywhere).
      donate: donate the input state's buffers to the output.
      overlap: True (the default): each layer's gather travels while the previous layer
        computes, and a layer's gradient reduce-scatter while the next one computes (one more
        layer's weights held; ``qsdp_jax._src.collective.overlap``). On GPUs XLA's collective
        pipelining does it; on TPUs the layer loops prefetch the next layer themselves
        (``ParamAccess.scan``) and the step is compiled with XLA:TPU's async collective
        options. False: the compiler's defaults, no prefetch. No effect on CPU.

    Returns:
      The step; it also has the jitted function's ``lower`` (e.g. for
      ``qsdp_jax.comm.comm_report``). Metrics: ``loss`` (the mean of the devices' losses, or
      the global weighted mean of a ``WeightedMean``), ``grad_norm`` (global,
      of the averaged gradient), ``nonfinite`` (1 when the update was skipped), ``step`` (the
      step taken).

    Raises:
      TypeError: ``config`` is not a :class:`QSDPConfig`, or ``mesh`` not a ``Mesh``.
      ValueError: the mesh's axes do not match the config's. Calling the step: a batch that is
        empty, has a scalar leaf, leaves of different leading sizes or a leading size that does
        not divide over the mesh's devices; an optimizer state made with another config (or
        not ``qsdp``-wrapped in ``"qsdp"`` mode).
      RuntimeError: calling the step with a state that was donated to an earlier call.
    """
    step_fn = train_step_fn(loss_fn, optimizer, mesh, config, has_aux, aux_out_spec, prefetch_layers(mesh, overlap))
    options = compiler_options(mesh, overlap)
    return CheckedStep(jax.jit(step_fn, donate_argnums=(0,) if donate else (), compiler_options=options), mesh)


def train_step_fn(loss_fn, optimizer, mesh: Mesh, config: QSDPConfig, has_aux, aux_out_spec, prefetch):
    """:func:`make_train_step`'s step before ``jax.jit`` (the NNX front door calls it inside its
    own jit); ``prefetch``: an ``overlap.Prefetch`` (the layer loops gather the next layer while
    this one computes) or None."""
    check_config(config)
    _, n_dev = mesh_sizes(mesh, config)
    axes, batch_axes = config.shard_axes, config.batch_axes

    def step_fn(state: TrainState, batch):
        check_batch(batch, n_dev)
        layout = state.layout
        pspecs = layout.specs(axes)
        wc.check_stored(state.params, state.layout, config)
        qoptim.check_same_config(state.opt_state, config)
        grid = grid_for_step(state.opt_state, config)
        aux_spec = P(batch_axes) if aux_out_spec is None else aux_out_spec
        body = sharded_body(
            local_grads(loss_fn, layout, config, has_aux, n_dev, prefetch),
            mesh,
            config,
            layout,
            grid,
            batch,
            (pspecs, P(), aux_spec if has_aux else P()),
        )
        grads, loss, aux = body(state.step, state.params, batch)
        params, opt_state, finite = _update(optimizer, config, mesh, layout, state, grads)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "nonfinite": (~finite).astype(jnp.int32),
            "step": state.step,
        }
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, layout=layout)
        return (new_state, metrics, aux) if has_aux else (new_state, metrics)

    return step_fn


def _update(optimizer, config: QSDPConfig, mesh: Mesh, layout: ParamLayout, state: TrainState, grads):
    """The optimizer step in the global view; the old state where anything is non-finite."""
    axes = config.shard_axes
    with layout_context(layout, mesh, axes):
        params = wc.decode(state.params, state.opt_state, config, layout)  # as they are unless code-held
        finite = qoptim.all_finite(grads)
        # gated by the flag of all of them, no leaf's update starts before every gradient is
        # reduced (else XLA:CPU began the blocks' updates with the embedding's full-size
        # gradients, 2 x 412 MB at GPT-1.3B, still waiting for their reduce-scatter)
        grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        updates, new_opt = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # the new weights too (before the snap, whose codes are always finite): an update can
        # overflow (e.g. float16 leaves) on finite grads
        finite = finite & qoptim.all_finite(new_params)
        if wc.holds_codes(config):  # the codes of the snapped weights are the weights' own codes
            new_params = wc.encode(new_params, new_opt, config, layout)
        elif config.weight_mode == "qsdp":
            new_params = qoptim.snap_to_grid(new_params, new_opt, config)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    new_params = jax.tree.map(keep, new_params, state.params)
    new_opt = jax.tree.map(keep, new_opt, state.opt_state)
    constrain = lambda tree, specs: jax.tree.map(  # noqa: E731  (the state keeps its placement)
        lambda s, x: lax.with_sharding_constraint(x, NamedSharding(mesh, s)),
        specs,
        tree,
        is_leaf=lambda x: isinstance(x, P),
    )
    new_params = constrain(new_params, wc.storage_specs(layout, config))
    new_opt = constrain(new_opt, opt_state_specs(new_opt, params, layout, axes))
    return new_params, new_opt, finite


def make_eval_step(
    loss_fn: Callable[..., Any], mesh: Mesh, config: QSDPConfig, *, overlap: bool = True
) -> Callable[[TrainState, PyTree], jax.Array]:
    """A jitted ``eval(state, batch) -> mean loss`` with the same gathers as training (lossless
    in ``"qsdp"`` mode: evaluation sees exactly the weights training uses).

    Args:
      loss_fn: as for :func:`make_train_step` (no aux): ``loss_fn(p, batch) -> loss``, the mean
        over the local batch.
      mesh: the state's mesh.
      config: the run's config.
      overlap: as for :func:`make_train_step`.

    Returns:
      The jitted ``eval(state, batch)``, giving the loss averaged over the devices (a
      replicated scalar); it never donates the state.

    Raises:
      TypeError: ``config`` is not a :class:`QSDPConfig`, or ``mesh`` not a ``Mesh``.
      ValueError: the mesh's axes do not match the config's. Calling it: a batch as
        :func:`make_train_step` refuses it; in ``"qsdp"`` mode a state whose optimizer is not
        ``qsdp``-wrapped or was built for other weight bits / bucket size.
      RuntimeError: calling it with a state that was donated to a train step.
    """
    check_config(config)
    _, n_dev = mesh_sizes(mesh, config)

    def eval_fn(state: TrainState, batch):
        check_batch(batch, n_dev)
        layout = state.layout
        wc.check_stored(state.params, state.layout, config)
        grid = grid_for_step(state.opt_state, config)
        local = local_loss(loss_fn, layout, config, prefetch_layers(mesh, overlap))
        body = sharded_body(local, mesh, config, layout, grid, batch, P())
        return body(state.step, state.params, batch)

    return CheckedStep(jax.jit(eval_fn, compiler_options=compiler_options(mesh, overlap)), mesh)


def gather_params(state: TrainState) -> dict[str, PyTree]:
    """The parameter pytree (the optimizer's values) of a TrainState: ``state.params``, global
    arrays as they are sharded, copied so that a later donating step does not delete them
    (code-held weights decoded: float32-held values, sharded like the leaves).

    Args:
      state: a train state.

    Returns:
      The params dict; ``jax.device_get`` it for host numpy arrays.
    """
    params = wc.decoded_params(state)
    return jax.tree.map(jnp.copy, params) if params is state.params else params
