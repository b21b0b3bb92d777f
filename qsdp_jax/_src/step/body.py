"""The per-device part of the train and eval steps (:mod:`qsdp_jax.train`): the ``shard_map``
body that reads the stored weights through the gathers, and the grid it is given.

The body takes ``(step, stored params, grid, batch)``: the step count (replicated; it keys the
stochastic rounding), ``TrainState.params`` as stored (float leaves or, code-held, their codes;
each device its blocks), the ``(scales, offsets)`` of the weight grid in ``"qsdp"`` mode (``()``
otherwise) and the device's slice of the batch.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from qsdp_jax import optim as qoptim
from qsdp_jax.config import QSDPConfig
from qsdp_jax.layout import ParamLayout
from qsdp_jax._src.quant import weight_codes as wc
from qsdp_jax._src.collective.hierarchy import device_mean
from qsdp_jax._src.step.sharded_access import ShardedParams
from qsdp_jax._src.step.weighted_mean import device_objective, global_loss, warn_if_masked


def grid_for_step(opt_state, config: QSDPConfig):
    """``(scales, offsets)`` trees of the weight grid (``"qsdp"`` mode), else None.

    Raises:
      ValueError: ``"qsdp"`` mode with an optimizer not ``qsdp``-wrapped, or built for other
        weight bits or bucket size.
    """
    if config.weight_mode != "qsdp":
        return None
    st = qoptim.find_qsdp_state(opt_state)
    if st is None:
        raise ValueError("weight_mode='qsdp' needs the optimizer wrapped with qsdp_jax.optim.qsdp(base, config)")
    if st.bits != config.weight_bits or st.bucket != config.bucket_size:
        raise ValueError(
            f"the optimizer was built for weight_bits={st.bits}, bucket_size={st.bucket}, but the "
            f"train step's config has weight_bits={config.weight_bits}, "
            f"bucket_size={config.bucket_size}: build both from the same QSDPConfig"
        )
    return st.scales, st.offsets


def sharded_body(local: Callable, mesh: Mesh, config: QSDPConfig, layout: ParamLayout, grid, batch, out_specs: Any):
    """``body(step, stored, batch)``: ``jax.shard_map`` of ``local(step, stored, grid, batch)``
    with ``grid`` (:func:`grid_for_step`'s, or ``None``: ``()``) bound, and the in_specs of the
    stored params (:func:`weight_codes.storage_specs`), the grid and the batch (split over every
    mesh axis)."""
    grid_specs: tuple = ()
    if grid is None:
        grid = ()
    else:
        specs = layout.grid_specs(config.shard_axes, config)
        grid_specs = (specs, specs)
    in_specs = (
        P(),
        wc.storage_specs(layout, config),
        grid_specs,
        jax.tree.map(lambda _: P(config.batch_axes), batch),
    )
    body = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return lambda step, stored, batch: body(step, stored, grid, batch)


def _reader(layout: ParamLayout, config: QSDPConfig, step, grid, codes, prefetch_layers) -> Callable:
    """``params -> ParamAccess`` of this device's blocks (anchors, for code-held leaves)."""
    return lambda params: ShardedParams(layout, params, grid or None, step, config, codes, prefetch_layers)


def local_loss(loss_fn: Callable, layout: ParamLayout, config: QSDPConfig, prefetch_layers=None):
    """The per-device body of the eval step: the loss averaged over the devices (a
    :class:`~qsdp_jax._src.step.weighted_mean.WeightedMean`: its global weighted mean)."""

    def local(step, stored, grid, batch):
        params, codes = wc.anchors(stored, layout, config)
        loss = loss_fn(_reader(layout, config, step, grid, codes, prefetch_layers)(params), batch)
        return global_loss(loss, config.batch_axes)

    return local


def local_grads(
    loss_fn: Callable, layout: ParamLayout, config: QSDPConfig, has_aux: bool, n_dev: int, prefetch_layers=None
):
    """The per-device body of the train step: ``(grads of this device's blocks, mean loss,
    aux)``; a sharded leaf's gradient averaged over the devices (the reduce-scatter sums),
    a replicated one's mean taken (:func:`hierarchy.device_mean`). A ``WeightedMean`` loss is
    made global first (:func:`weighted_mean.device_objective`)."""

    def local(step, stored, grid, batch):
        params, codes = wc.anchors(stored, layout, config)
        access = _reader(layout, config, step, grid, codes, prefetch_layers)

        def objective(p):
            out = loss_fn(access(p), batch)
            loss, aux = out if has_aux else (out, None)
            warn_if_masked(loss, batch)
            return device_objective(loss, config.batch_axes, n_dev), aux

        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        leaves = [g / n_dev if x.sharded else device_mean(g, config) for g, (_, x) in zip(leaves, layout.leaves())]
        return jax.tree_util.tree_unflatten(treedef, leaves), lax.pmean(loss, config.batch_axes), aux

    return local
