"""The NNX front door's step: :class:`TrainStep`, the jitted step of an ``nnx.Module``'s loss
(made by ``qsdp_jax.nnx.make_train_step`` / ``make_eval_step``, re-exported as
``qsdp_jax.nnx.TrainStep``)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import flax.errors
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from qsdp_jax import train
from qsdp_jax._src.step import guards
from qsdp_jax._src.collective.hierarchy import mesh_sizes
from qsdp_jax._src.nnx.annotations import explain_manual_error, is_manual_error
from qsdp_jax._src.nnx.call_rngs import CallRngs, closure_error
from qsdp_jax._src.nnx.chain import Recorder, Runner, find_chains
from qsdp_jax._src.nnx.checks import check_fits, split_loss, state_label, warn_mode
from qsdp_jax._src.nnx.closure import stand_in
from qsdp_jax._src.nnx.reshard import can_reshard_any
from qsdp_jax._src.nnx.scan import StepContext
from qsdp_jax._src.nnx.summary import summary_table, warn_whole
from qsdp_jax._src.nnx.tree import ModelDef, describe, in_mode, mode_differences
from qsdp_jax._src.collective.overlap import compiler_options, prefetch_layers, scan_blocks_default
from qsdp_jax.config import check_config
from qsdp_jax.kernels.compile_errors import kernel_failures_explained

PyTree = Any


class TrainStep:
    """A jitted ``step(state, batch) -> (state, metrics[, aux])`` for an NNX model.

    Made by :func:`make_train_step` (and, as ``eval(state, batch) -> mean loss``, by
    :func:`make_eval_step`); not meant to be built directly. Calling it checks the state first
    (not donated to an earlier call, on the step's mesh, of this module). Also
    ``lower(state, batch)`` (for ``qsdp_jax.comm.comm_report``) and ``summary(state, batch)``:
    how each group is gathered and the memory a whole-stack gather costs.

    Calling it raises ``RuntimeError`` for a donated state, ``TypeError`` for a state that is
    not a ``TrainState``, ``ValueError`` for a state on another mesh or of another model, a
    ``loss_fn`` that does not return a scalar floating loss (or ``(loss, aux)`` with
    ``has_aux``), or one that computes with the parameters of ``model`` itself (a closure over
    it, not the module it is given: ``qsdp_jax._src.nnx.closure``), and the errors of
    ``qsdp_jax.make_train_step``'s step (the batch).

    Args:
      model: the module (read for its structure in ``mode``).
      loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``); the
        loss a scalar (the mean over the local batch) or a :class:`~qsdp_jax.WeightedMean` for
        a loss normalised by a count of its batch, e.g. real tokens (the global ratio trains).
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
      take_embeddings: see :func:`make_train_step`.
      overlap: see :func:`make_train_step`.
      scan_blocks: see :func:`make_train_step`.

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
        take_embeddings=False,
        rngs=None,
        overlap=True,
        scan_blocks=None,
    ):
        check_config(config)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
        self.model = model  # the user's: its parameters stand in while loss_fn traces (nnx_closure)
        graph = in_mode(model, mode)  # the module runs from this copy's graph, in the step's mode
        if mode == "train":
            warn_mode(mode_differences(model, graph))
        self.mdef: ModelDef = describe(graph, stacked)
        self.n = mesh_sizes(mesh, config)[1]  # every device: the batch is split over all
        self.loss_fn, self.optimizer, self.mesh, self.config = loss_fn, optimizer, mesh, config
        self.has_aux, self.aux_out_spec, self.evaluate = has_aux, aux_out_spec, evaluate
        # reshard only where it can apply: a train step with a group called as a module
        self.reshard = reshard_after_forward and not evaluate and can_reshard_any(graph, self.mdef)
        self.take_embeddings = take_embeddings
        self.scan_blocks = scan_blocks_default(mesh, overlap) if scan_blocks is None else scan_blocks
        self.prefetch = prefetch_layers(mesh, overlap)  # a chain's scan gathers ahead
        self.rngs = None if rngs is None else CallRngs(rngs)  # passed to loss_fn as rngs=
        self.record: dict[str, str] = {}
        self._jitted = jax.jit(
            self._step,
            donate_argnums=(0,) if donate and not evaluate else (),
            compiler_options=compiler_options(mesh, overlap),  # layer collectives hidden on GPUs and TPUs
        )

    def __call__(self, state: train.TrainState, batch: PyTree):
        if isinstance(state, train.TrainState):
            guards.check_not_donated(state, state_label)
            guards.check_mesh(state, self.mesh, state_label)
        with kernel_failures_explained(self.mesh.devices.flat[0].device_kind):
            return self._jitted(state, batch)

    def trace(self, state, batch):
        """Trace the jitted step for ``state`` and ``batch`` (no state checks, nothing runs):
        what ``jax.export.export(step)`` calls, with :meth:`lower` (``jax.stages.Wrapped``).

        Args:
          state: a :class:`qsdp_jax.TrainState` of this module, concrete or abstract.
          batch: a batch (arrays or ``jax.ShapeDtypeStruct``).

        Returns:
          The ``jax.stages.Traced`` step.

        Raises:
          TypeError: ``state`` is not a ``TrainState``.
          ValueError: as for :meth:`lower`.
        """
        return self._jitted.trace(state, batch)

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
        chains = None
        if self.reshard:
            # a first, abstract trace finds the groups the loss also reads outside their own
            # __call__ (a tied embedding's attend): those are gathered once and held, as
            # resharding them would gather them twice in the forward pass; it also records the
            # resharded calls, to find the chains of alike blocks run as one scan (nnx_chain)
            probe: dict[str, str] = {}
            recorder = Recorder() if self.scan_blocks else None
            jax.eval_shape(lambda: self._traced_loss(access.fresh(), batch, extra, probe, frozenset(), recorder))
            held = frozenset(name for name, how in probe.items() if how == "whole")
            if recorder is not None:
                chains = Runner(find_chains([c for c in recorder.calls if c.group not in held]))
        return self._traced_loss(access, batch, extra, self.record, held, chains=chains)

    def _traced_loss(self, access, batch, extra, record: dict, held, recorder=None, chains=None):
        """The loss on the module built for this trace; ``held``: groups not resharded;
        ``recorder`` / ``chains``: the first trace's call records / the chains found in them."""
        ctx = StepContext(
            access,
            self.mdef,
            self.config.batch_axes,
            record,
            self.reshard,
            held,
            self.take_embeddings,
            recorder,
            chains,
        )
        with ctx.active(), stand_in(self.model):
            module = ctx.build(extra["state"], extra["step"])
            kwargs = {} if self.rngs is None else {"rngs": self.rngs.for_step(extra["step"], self.config.batch_axes)}
            try:
                out = self.loss_fn(module, batch, **kwargs)
            except flax.errors.TraceContextError as e:
                raise closure_error(e) from e
            except (NotImplementedError, ValueError) as e:
                if not is_manual_error(e):
                    raise
                raise explain_manual_error(e) from e
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
            # nested in this step's jit, which carries the compiler options (a nested jit may not)
            eval_fn = train.make_eval_step(lambda p, b: self._loss(p, b)[0], self.mesh, self.config, overlap=False)
            return eval_fn(inner, xbatch)
        aux_spec = P(self.config.batch_axes) if self.aux_out_spec is None else self.aux_out_spec
        aux_specs = {"aux": aux_spec, "state": P()}  # this step's jit carries the compiler options
        fn = train.train_step_fn(self._loss, self.optimizer, self.mesh, self.config, True, aux_specs, self.prefetch)
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
