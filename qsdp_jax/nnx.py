"""The Flax NNX front door: train an ordinary ``nnx.Module`` with QSDP on a mesh.

Usage::

    model = MyModel(rngs=nnx.Rngs(0))                       # any nnx.Module
    def loss_fn(model, batch):                                # the ordinary NNX way
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    mesh = qsdp_jax.make_mesh()
    config = qsdp_jax.QSDPConfig.qsdp(weight_bits=8, grad_bits=8)
    opt = qsdp_jax.optim.qsdp(optax.adam(1e-3), config)
    state = qsdp_jax.nnx.init_state(model, opt, mesh, config)
    step = qsdp_jax.nnx.make_train_step(model, loss_fn, opt, mesh, config)
    state, metrics = step(state, batch)
    qsdp_jax.nnx.update(model, state)                          # weights back into the module

The module stays yours: the state owns copies of what it holds, so no step donates or deletes an
array of the module (or of an ``nnx.clone`` of it). Between steps the module computes with the
weights of its last :func:`update` (those of :func:`init_state` before the first), so a
``loss_fn`` that computes with it (a closure) instead of the module it is given is refused
while the step traces (``qsdp_jax._src.nnx.closure``). The train
step runs the module in training mode and the eval step in eval mode (as ``model.train()`` /
``model.eval()`` set them) whatever mode the module is in; ``mode=None`` runs it as it was when
the step was built.

The parameter groups (the unit of one gather), the layer stacks (nested ones included, e.g.
``"trunk/layers"``) and the model state come from the module tree
(``qsdp_jax._src.nnx.tree``; ``describe(model).groups`` lists what was found). The
step is ``qsdp_jax.make_train_step`` with a loss that merges the module from its cached
``GraphDef`` with parameters gathered on first read (``qsdp_jax._src.nnx.scan``). Layer stacks
are gathered one layer at a time where the forward scans them with :func:`scan` (the
``nnx.scan`` drop-in); read any other way a stack is gathered whole, with a warning, and
``step.summary(state, batch)`` states the memory this costs. A group that is a module called
through its ``__call__`` (a block of an ``nnx.List`` in a Python loop) is gathered for the call
and gathered again in the backward pass (``reshard_after_forward``, PyTorch FSDP2's; the rules
in ``qsdp_jax._src.nnx.reshard``), so a list of blocks holds about one block's weights too.
With ``take_embeddings=True`` an ``nnx.Embed`` lookup reads its rows from the devices' blocks
(``ParamAccess.take``) instead of gathering its table.

RNG streams: every ``nnx.RngKey`` is folded with the step and the device index inside the step,
so a dropout mask is a pure function of (seed, step, device, the call's position) and a resumed
run draws exactly what the uninterrupted one did. Model state (``TrainState.model_state``):
``nnx.BatchStat`` variables are averaged over the devices after each step (each device's
statistics are of its slice of the batch); other non-parameter variables are carried as
computed; RNG keys and counts are carried unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from qsdp_jax import train

from qsdp_jax._src.step import guards
from qsdp_jax.config import QSDPConfig
from qsdp_jax._src.nnx.scan import scan  # noqa: F401  (re-exported: qsdp_jax.nnx.scan)
from qsdp_jax._src.nnx.step import TrainStep
from qsdp_jax._src.nnx.tree import ModelDef, describe, group_params, model_state, path_str, set_model_state, set_params  # noqa: F401
from qsdp_jax._src.nnx.checks import INT_HINT, check_fits, param_label, state_label

PyTree = Any

__all__ = [
    "TrainStep",
    "abstract_state",
    "describe",
    "init_state",
    "make_eval_step",
    "make_train_step",
    "scan",
    "update",
]


def init_state(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    config: QSDPConfig,
    *,
    stacked: Sequence[str] | None = None,
) -> train.TrainState:
    """The sharded :class:`qsdp_jax.TrainState` of ``model``'s parameters and model state.

    The state holds copies: a donating step never deletes an array of ``model`` (or of a
    clone of it), and the module keeps these weights until :func:`update` writes new ones.

    Args:
      model: the module (its ``nnx.Param`` variables are trained).
      optimizer: as for ``qsdp_jax.init_train_state``.
      mesh: the mesh the steps run on.
      config: the run's config.
      stacked: the layer-stack groups, where the automatic rule (``qsdp_jax._src.nnx.tree``)
        guesses wrong: top-level group names or paths of nested sub-modules
        (``"trunk/layers"``); pass the same to :func:`make_train_step`. None (the default):
        the automatic rule, which also finds stacks nested below the top level.

    Returns:
      The :class:`qsdp_jax.TrainState` at step 0, its ``model_state`` the module's
      non-parameter variables (replicated copies).

    Raises:
      TypeError: an ``nnx.Param`` that is not floating point; ``model`` not an ``nnx.Module``;
        ``stacked`` a string; ``config`` not a ``QSDPConfig`` or ``mesh`` not a ``Mesh``.
      ValueError: an ``nnx.Param`` holding NaN or Inf, or a module without ``nnx.Param``; a
        ``stacked`` name that is not a group of the module, or whose variables share no
        leading layer axis; and the errors of ``qsdp_jax.init_train_state`` (mesh axes,
        layout, optimizer).
    """
    guards.check_stacked(stacked)
    mdef = describe(model, stacked)
    params = group_params(model, mdef)
    guards.check_params(params, mdef.stacked, label=param_label, int_hint=INT_HINT)
    state = train.init_checked_state(params, optimizer, mesh, config, mdef.stacked)
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=NamedSharding(mesh, P()))
    return dataclasses.replace(state, model_state=copy(model_state(model, mdef)))


def abstract_state(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    config: QSDPConfig,
    *,
    stacked: Sequence[str] | None = None,
) -> train.TrainState:
    """The :func:`init_state` of ``model`` as ``jax.ShapeDtypeStruct`` leaves with their
    shardings, allocating nothing: compile a step for it to read its memory
    (``step.lower(abstract, batch).compile().memory_analysis()``) for a model too large for
    this host. ``model`` may itself be abstract (``nnx.eval_shape(lambda: MyModel(...))``).

    ``jax.eval_shape(lambda: init_state(...))`` is no substitute: its leaves carry no sharding,
    so a step compiled for them holds every array whole on every device.

    Args:
      model, optimizer, mesh, config, stacked: as for :func:`init_state`.

    Returns:
      The :class:`qsdp_jax.TrainState` :func:`init_state` would return, abstract.

    Raises:
      As :func:`init_state`, less the NaN check (no values are looked at).
    """
    guards.check_stacked(stacked)
    mdef = describe(model, stacked)
    state = train.abstract_train_state(group_params(model, mdef), optimizer, mesh, config, stacked=mdef.stacked)
    replicated = NamedSharding(mesh, P())
    others = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param))):
        value = var.get_raw_value()
        if isinstance(var, nnx.RngKey):
            value = jax.eval_shape(jax.random.key_data, value)
        shape, dtype = jnp.shape(value), getattr(value, "dtype", None) or jnp.result_type(value)
        others[path_str(path)] = jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    return dataclasses.replace(state, model_state=others)


def update(model: nnx.Module, state: train.TrainState) -> None:
    """Write the state's weights (the optimizer's values) and model state into ``model``.

    The module receives copies: the next (donating) step leaves it intact, and it keeps these
    values until the next ``update``.

    Args:
      model: the module the state was made from (:func:`init_state`), or one of the same
        structure; updated in place.
      state: a :class:`qsdp_jax.TrainState` from :func:`init_state` or a step.

    Raises:
      ValueError: the state does not fit the module (another model's: paths and shapes named).
      RuntimeError: the state was donated to a step call.
    """
    mdef = describe(model, [g.name for g in state.layout.groups if g.stacked])
    guards.check_not_donated(state, state_label)
    check_fits(mdef, state)
    set_params(model, mdef, train.gather_params(state))
    if state.model_state is not None:
        set_model_state(model, mdef, jax.tree.map(jnp.copy, state.model_state))


def make_train_step(
    model: nnx.Module,
    loss_fn: Callable[[nnx.Module, PyTree], Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    config: QSDPConfig,
    *,
    has_aux: bool = False,
    aux_out_spec: Any = None,
    donate: bool = True,
    stacked: Sequence[str] | None = None,
    mode: str | None = "train",
    reshard_after_forward: bool = True,
    take_embeddings: bool = False,
    rngs: nnx.Rngs | None = None,
    overlap: bool = True,
    scan_blocks: bool | None = None,
) -> TrainStep:
    """The sharded train step of ``loss_fn(model, batch)`` (see the module docstring).

    The step runs the module's structure as it is now, in ``mode`` (training mode by default);
    its values come from the state. It never touches ``model``: toggling its mode later changes
    no step.

    Args:
      model: the module (read for its structure; none of its arrays is used or donated).
      loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``): the
        mean loss over the local batch, or a :class:`qsdp_jax.WeightedMean` ``(total, weight)``
        for a loss normalised by a count of its batch (real tokens of padded rows): the step
        trains the global ratio, the one-device objective.
      optimizer: the optimizer the state was made with.
      mesh: the state's mesh.
      config: the run's config.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is concatenated over the devices on
        its leading axis unless ``aux_out_spec`` says otherwise.
      aux_out_spec: out_specs for ``aux`` (as ``qsdp_jax.make_train_step``).
      donate: donate the input state's buffers to the output (a donated state used again is a
        ``RuntimeError``).
      stacked: as for :func:`init_state`.
      mode: ``"train"`` (as ``model.train()`` sets it: dropout on, batch statistics updated;
        a module in eval mode is warned about), ``"eval"``, or ``None``: the module's
        ``deterministic`` / ``use_running_average`` attributes as they are now (e.g. frozen
        batch statistics).
      reshard_after_forward: True (the default): a group called as a module (``block(x)``) is
        gathered for its call and gathered again in the backward pass, which re-runs the
        call's forward: peak memory holds one or two such groups' weights, at the price of a
        second all-gather of each (``comm_report`` counts it). False: every group read in the
        forward pass stays gathered until its gradient is taken (fewer collectives, more
        memory). Stacks read with :func:`scan` are gathered per layer either way. The same
        arithmetic either way (the same values up to XLA's fusion choices).
      take_embeddings: False (the default): an ``nnx.Embed`` lookup reads the table, which
        gathers its group. True: it reads the looked-up rows from the devices' blocks
        (``ParamAccess.take``; ``qsdp_jax._src.nnx.take``), so no device holds the whole table for
        the lookup and a tied table is gathered for its ``attend`` alone. The rows travel in
        float32, each device's rows to every device: worth it for a large vocabulary on few
        devices (GPT-2's at 8 devices), not for a small one.
      rngs: RNG streams for the call, NNX's style for dropout built without rngs
        (``model(x, rngs=rngs)``): the step calls ``loss_fn(model, batch, rngs=...)`` with an
        ``nnx.Rngs`` of these streams, every key folded with the step and the device (fresh
        masks each step and device; a resumed run draws the same). None (the default): the
        step calls ``loss_fn(model, batch)``; streams the module holds are folded the same way.
      overlap: True (the default): on GPUs, XLA's collective pipelining hides each layer's
        gathers and gradient collectives behind the neighbouring layer's compute (as
        ``qsdp_jax.make_train_step``). False: the compiler's defaults.
      scan_blocks: True: resharded blocks called one after the other on each other's output
        (``for block in self.blocks: x = block(x, mask)``), alike in their parameters, run as
        one ``lax.scan`` with one compiled body per distinct block graph (a local and a global
        attention layer), so compile time no longer grows with the block count; the same
        values and gradients up to XLA's fusion choices (the rule:
        ``qsdp_jax._src.nnx.chain``). False: every block call unrolled. None (the default):
        True, except on GPUs with ``overlap=True``, where XLA's collective pipelining of the
        chain's loops cost more compile time than the chain saved
        (``qsdp_jax._src.collective.overlap.scan_blocks_default``). Only with ``reshard_after_forward``.

    Returns:
      The :class:`TrainStep`; metrics as ``qsdp_jax.make_train_step``.

    Raises:
      TypeError: ``config`` is not a ``QSDPConfig``, ``loss_fn`` not callable, ``model`` not an
        ``nnx.Module``, or ``mesh`` not a ``Mesh``.
      ValueError: an invalid ``mode``; a ``stacked`` name that is not a group of the module; the
        mesh's axes do not match the config's. Calling the step: see :class:`TrainStep`.
    """
    return TrainStep(
        model,
        loss_fn,
        optimizer,
        mesh,
        config,
        has_aux=has_aux,
        aux_out_spec=aux_out_spec,
        donate=donate,
        stacked=stacked,
        mode=mode,
        reshard_after_forward=reshard_after_forward,
        take_embeddings=take_embeddings,
        rngs=rngs,
        overlap=overlap,
        scan_blocks=scan_blocks,
    )


def make_eval_step(
    model: nnx.Module,
    loss_fn: Callable[[nnx.Module, PyTree], Any],
    mesh: Mesh,
    config: QSDPConfig,
    *,
    stacked: Sequence[str] | None = None,
    mode: str | None = "eval",
    take_embeddings: bool = False,
    rngs: nnx.Rngs | None = None,
    overlap: bool = True,
) -> TrainStep:
    """A jitted ``eval(state, batch) -> mean loss`` with the training gathers; the model state
    is read, not updated.

    The module runs in eval mode (as ``model.eval()`` sets it) whatever mode it is in now. No
    warning for a module in training mode: a new module is in it, and building the eval step
    next to the train step is the usual way.

    Args:
      model: the module (read for its structure only).
      loss_fn: ``loss_fn(model, batch) -> loss`` (no aux).
      mesh: the state's mesh.
      config: the run's config.
      stacked: as for :func:`init_state`.
      mode: ``"eval"`` (the default), ``"train"`` or ``None`` (as for :func:`make_train_step`).
      take_embeddings: as for :func:`make_train_step`.
      rngs: as for :func:`make_train_step` (for a ``loss_fn`` that takes ``rngs``).
      overlap: as for :func:`make_train_step`.

    Returns:
      A :class:`TrainStep` computing ``eval(state, batch) -> mean loss`` (global mean, or the
      global weighted mean of a ``WeightedMean``; a replicated scalar); it never donates the
      state.

    Raises:
      TypeError: as for :func:`make_train_step`.
      ValueError: as for :func:`make_train_step`.
    """
    return TrainStep(
        model,
        loss_fn,
        None,
        mesh,
        config,
        has_aux=False,
        aux_out_spec=None,
        donate=False,
        stacked=stacked,
        mode=mode,
        evaluate=True,
        take_embeddings=take_embeddings,
        rngs=rngs,
        overlap=overlap,
    )
