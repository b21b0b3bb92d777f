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
weights of its last :func:`update` (those of :func:`init_state` before the first). The train
step runs the module in training mode and the eval step in eval mode (as ``model.train()`` /
``model.eval()`` set them) whatever mode the module is in; ``mode=None`` runs it as it was when
the step was built.

The parameter groups (the unit of one gather), the layer stacks (nested ones included, e.g.
``"trunk/layers"``) and the model state come from the module tree
(``qsdp_jax._src.nnx_tree``; ``describe(model).groups`` lists what was found). The
step is ``qsdp_jax.make_train_step`` with a loss that merges the module from its cached
``GraphDef`` with parameters gathered on first read (``qsdp_jax._src.nnx_scan``). Layer stacks
are gathered one layer at a time where the forward scans them with :func:`scan` (the
``nnx.scan`` drop-in); read any other way a stack is gathered whole, with a warning, and
``step.summary(state, batch)`` states the memory this costs. A group that is a module called
through its ``__call__`` (a block of an ``nnx.List`` in a Python loop) is gathered for the call
and gathered again in the backward pass (``reshard_after_forward``, PyTorch FSDP2's; the rules
in ``qsdp_jax._src.nnx_reshard``), so a list of blocks holds about one block's weights too.

RNG streams: every ``nnx.RngKey`` is folded with the step and the device index inside the step,
so a dropout mask is a pure function of (seed, step, device, the call's position) and a resumed
run draws exactly what the uninterrupted one did. Model state (``TrainState.model_state``):
``nnx.BatchStat`` variables are averaged over the devices after each step (each device's
statistics are of its slice of the batch); other non-parameter variables are carried as
computed; RNG keys and counts are carried unchanged.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from qsdp_jax import train

from qsdp_jax._src import guards
from qsdp_jax.config import QSDPConfig, check_config
from qsdp_jax._src.nnx_scan import scan  # noqa: F401  (re-exported: qsdp_jax.nnx.scan)
from qsdp_jax._src.nnx_scan import StepContext
from qsdp_jax._src.nnx_reshard import can_reshard_any
from qsdp_jax._src.nnx_tree import ModelDef, describe, group_params, model_state, set_model_state, set_params  # noqa: F401
from qsdp_jax._src.nnx_tree import in_mode, mode_differences
from qsdp_jax._src.nnx_checks import INT_HINT, check_fits, param_label, split_loss, state_label, warn_mode
from qsdp_jax._src.nnx_summary import summary_table, warn_whole
from qsdp_jax._src.hierarchy import mesh_sizes

PyTree = Any

__all__ = ["TrainStep", "describe", "init_state", "make_eval_step", "make_train_step", "scan", "update"]


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
      stacked: the layer-stack groups, where the automatic rule (``qsdp_jax._src.nnx_tree``)
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


class TrainStep:
    """A jitted ``step(state, batch) -> (state, metrics[, aux])`` for an NNX model.

    Made by :func:`make_train_step` (and, as ``eval(state, batch) -> mean loss``, by
    :func:`make_eval_step`); not meant to be built directly. Calling it checks the state first
    (not donated to an earlier call, on the step's mesh, of this module). Also
    ``lower(state, batch)`` (for ``qsdp_jax.comm.comm_report``) and ``summary(state, batch)``:
    how each group is gathered and the memory a whole-stack gather costs.

    Calling it raises ``RuntimeError`` for a donated state, ``TypeError`` for a state that is
    not a ``TrainState``, ``ValueError`` for a state on another mesh or of another model, or a
    ``loss_fn`` that does not return a scalar floating loss (or ``(loss, aux)`` with
    ``has_aux``), and the errors of ``qsdp_jax.make_train_step``'s step (the batch).

    Args:
      model: the module (read for its structure in ``mode``).
      loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      optimizer: the optimizer the state was made with (None for an eval step).
      mesh: the state's mesh.
      config: the run's config.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      aux_out_spec: out_specs for ``aux`` (None: concatenated over the devices).
      donate: donate the input state's buffers to the output (never for an eval step).
      stacked: the layer-stack groups, or None for the automatic rule.
      mode: ``"train"``, ``"eval"`` or None (see :func:`make_train_step`).
      evaluate: an eval step (:func:`make_eval_step`) instead of a train step.
      reshard_after_forward: see :func:`make_train_step`.

    Raises:
      TypeError: ``config`` is not a ``QSDPConfig``, ``loss_fn`` not callable, ``model`` not an
        ``nnx.Module``, or ``mesh`` not a ``Mesh``.
      ValueError: ``mode`` is not ``"train"``, ``"eval"`` or None; a ``stacked`` name is not a
        group of the module (or shares no layer axis); the mesh's axes do not match the config.
    """

    def __init__(
        self,
        model,
        loss_fn,
        optimizer,
        mesh,
        config,
        *,
        has_aux,
        aux_out_spec,
        donate,
        stacked,
        mode,
        evaluate=False,
        reshard_after_forward=True,
    ):
        check_config(config)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
        graph = in_mode(model, mode)  # the module runs from this copy's graph, in the step's mode
        if mode == "train":
            warn_mode(mode_differences(model, graph))
        self.mdef: ModelDef = describe(graph, stacked)
        self.n = mesh_sizes(mesh, config)[1]  # every device: the batch is split over all
        self.loss_fn, self.optimizer, self.mesh, self.config = loss_fn, optimizer, mesh, config
        self.has_aux, self.aux_out_spec, self.evaluate = has_aux, aux_out_spec, evaluate
        # reshard only where it can apply: a train step with a group called as a module
        self.reshard = reshard_after_forward and not evaluate and can_reshard_any(graph, self.mdef)
        self.record: dict[str, str] = {}
        self._jitted = jax.jit(self._step, donate_argnums=(0,) if donate and not evaluate else ())

    def __call__(self, state: train.TrainState, batch: PyTree):
        if isinstance(state, train.TrainState):
            guards.check_not_donated(state, state_label)
            guards.check_mesh(state, self.mesh, state_label)
        return self._jitted(state, batch)

    def lower(self, state, batch):
        """Lower the jitted step for ``state`` and ``batch`` (no state checks, nothing runs).

        Args:
          state: a :class:`qsdp_jax.TrainState` of this module, concrete or abstract.
          batch: a batch (arrays or ``jax.ShapeDtypeStruct``).

        Returns:
          The ``jax.stages.Lowered`` step (``.compile()`` it, or pass it to
          ``qsdp_jax.comm.comm_report``).

        Raises:
          TypeError: ``state`` is not a ``TrainState``.
          ValueError: a state of another model, a ``loss_fn`` result or a batch the step
            refuses (see the class docstring).
        """
        return self._jitted.lower(state, batch)

    # --- the step ---------------------------------------------------------------------------
    def _loss(self, access, xbatch):
        batch = xbatch["batch"]
        extra = jax.tree.map(lambda x: x[0], xbatch["extra"])
        held: frozenset[str] = frozenset()
        if self.reshard:
            # a first, abstract trace finds the groups the loss also reads outside their own
            # __call__ (a tied embedding's attend): those are gathered once and held, as
            # resharding them would gather them twice in the forward pass
            probe: dict[str, str] = {}
            jax.eval_shape(lambda: self._traced_loss(access.fresh(), batch, extra, probe, frozenset()))
            held = frozenset(name for name, how in probe.items() if how == "whole")
        return self._traced_loss(access, batch, extra, self.record, held)

    def _traced_loss(self, access, batch, extra, record: dict, held):
        """The loss on the module built for this trace; ``held``: groups not resharded."""
        ctx = StepContext(access, self.mdef, self.config.batch_axes, record, self.reshard, held)
        with ctx.active():
            module = ctx.build(extra["state"], extra["step"])
            out = self.loss_fn(module, batch)
        loss, aux = split_loss(out, self.has_aux)
        return loss, {"aux": aux, "state": ctx.read_state(module, extra["state"])}

    def _step(self, state: train.TrainState, batch):
        check_fits(self.mdef, state)  # at trace time: a state of other shapes is a new trace
        self.record.clear()  # filled while this trace runs the loss
        # one copy per example (as many as the batch's leading size, a multiple of the devices):
        # the step checks that every batch leaf holds the same number of examples
        rows = next((x.shape[0] for x in jax.tree.leaves(batch) if jnp.ndim(x)), self.n)
        tile = lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (rows, *jnp.shape(x)))  # noqa: E731
        extra = {"state": jax.tree.map(tile, state.model_state or {}), "step": tile(state.step)}
        xbatch = {"batch": batch, "extra": extra}
        inner = dataclasses.replace(state, model_state=None)
        if self.evaluate:
            eval_fn = train.make_eval_step(lambda p, b: self._loss(p, b)[0], self.mesh, self.config)
            return eval_fn(inner, xbatch)
        aux_spec = P(self.config.batch_axes) if self.aux_out_spec is None else self.aux_out_spec
        fn = train.make_train_step(
            self._loss,
            self.optimizer,
            self.mesh,
            self.config,
            has_aux=True,
            aux_out_spec={"aux": aux_spec, "state": P()},
            donate=False,
        )
        new, metrics, aux = fn(inner, xbatch)
        new = dataclasses.replace(new, model_state=aux["state"])
        warn_whole(self.mdef.stacked, self.record)
        return (new, metrics, aux["aux"]) if self.has_aux else (new, metrics)

    def summary(self, state: train.TrainState, batch: PyTree) -> str:
        """How each group is gathered in this step, and the peak bytes of gathered weights.

        Traces the step afresh (``jax.eval_shape``: nothing is computed, its warnings are
        silenced) and reads what the loss gathered.

        Args:
          state: a :class:`qsdp_jax.TrainState` of this module, concrete or abstract.
          batch: a batch, concrete or abstract.

        Returns:
          A text table with, per group, its layer count, how it was gathered (``"not read"``,
          ``"whole"`` (held to the backward pass), ``"per layer"`` for a stack scanned with
          :func:`scan`, ``"per call"`` for a group resharded after its call) and the float32
          bytes of gathered weights it holds at once (a note when a whole stack costs more
          than one layer), then the total per device (the held groups plus the two largest
          resharded ones); with a bit policy, the bits of every sharded leaf.

        Raises:
          TypeError: ``state`` is not a ``TrainState``.
          ValueError: a state of another model, a ``loss_fn`` result or a batch the step
            refuses (see the class docstring).
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.eval_shape(lambda s, b: self._step(s, b), state, batch)  # a fresh trace
        return summary_table(state.layout, self.record, self.config)


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
) -> TrainStep:
    """The sharded train step of ``loss_fn(model, batch)`` (see the module docstring).

    The step runs the module's structure as it is now, in ``mode`` (training mode by default);
    its values come from the state. It never touches ``model``: toggling its mode later changes
    no step.

    Args:
      model: the module (read for its structure; none of its arrays is used or donated).
      loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``): the
        mean loss over the local batch.
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
    )


def make_eval_step(
    model: nnx.Module,
    loss_fn: Callable[[nnx.Module, PyTree], Any],
    mesh: Mesh,
    config: QSDPConfig,
    *,
    stacked: Sequence[str] | None = None,
    mode: str | None = "eval",
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

    Returns:
      A :class:`TrainStep` computing ``eval(state, batch) -> mean loss`` (global mean, a
      replicated scalar); it never donates the state.

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
    )
