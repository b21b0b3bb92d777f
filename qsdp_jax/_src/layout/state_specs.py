"""How the optimizer state is sharded: each leaf like the parameter it belongs to.

Optax states embed the params' structure (Adam's ``mu`` and ``nu``, a trace, Muon's momentum):
an optimizer-state leaf whose key path ends with a parameter's key path and whose shape is that
parameter's is sharded exactly like it, so the update is elementwise on each device's block
with no data movement. Any other leaf (counts, Adafactor's factored statistics, QSDP's per-bucket
grids, a schedule's state) is split on its *last* dimension that divides over the shard count,
or replicated when none does (scalars, small vectors). The answer is always valid: the
optimizer runs in the global view (``jax.jit``), so a placement only decides where XLA keeps
the bytes, never what is computed.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from qsdp_jax.layout import ParamLayout

PyTree = Any


def _keys(path) -> tuple:
    return tuple(str(k) for k in path)


def fallback_spec(shape: tuple[int, ...], num_shards: int, axes) -> P:
    """Split on the last dimension dividing ``num_shards``; replicated if none (or size 0)."""
    if not shape or 0 in shape or num_shards == 1:
        return P()
    for d in reversed(range(len(shape))):
        if shape[d] % num_shards == 0:
            spec = [None] * len(shape)
            spec[d] = axes
            return P(*spec)
    return P()


def _param_paths(params: PyTree, specs: list | None = None) -> dict:
    """key path -> (shape, spec) of every params leaf (spec None when ``specs`` is None)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = specs if specs is not None else [None] * len(flat)
    return {_keys(path): (tuple(leaf.shape), spec) for (path, leaf), spec in zip(flat, specs)}


def _match(by_path: dict, path, leaf):
    """The ``by_path`` entry of the parameter ``leaf`` belongs to (its key path ends with the
    parameter's and its shape is the parameter's), or None."""
    shape, keys = tuple(leaf.shape), _keys(path)
    for k in range(len(keys) + 1):  # the empty suffix: params that are one bare array
        hit = by_path.get(keys[k:])
        if hit is not None and hit[0] == shape:
            return hit
    return None


def param_shaped_leaves(opt_state: PyTree, params: PyTree) -> list[bool]:
    """For each leaf of ``opt_state`` (flattened): whether it belongs to a parameter (the rule
    of :func:`opt_state_specs`)."""
    by_path = _param_paths(params)
    flat = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    return [_match(by_path, path, leaf) is not None for path, leaf in flat]


def opt_state_specs(opt_state: PyTree, params: PyTree, layout: ParamLayout, axes) -> PyTree:
    """The PartitionSpec of every leaf of ``opt_state`` (arrays or ShapeDtypeStructs).

    Args:
      opt_state: the optimizer state (or its ``jax.eval_shape``).
      params: the params (or their shapes), whose key paths the state's leaves end with.
      layout: the params' layout (their specs).
      axes: the shard axes (``QSDPConfig.shard_axes``).
    """
    specs = jax.tree_util.tree_leaves(layout.specs(axes), is_leaf=lambda x: isinstance(x, P))
    by_path = _param_paths(params, specs)

    def rule(path, leaf):
        hit = _match(by_path, path, leaf)
        return hit[1] if hit is not None else fallback_spec(tuple(leaf.shape), layout.num_shards, axes)

    return jax.tree_util.tree_map_with_path(rule, opt_state)


def opt_state_shardings(opt_state, params, layout: ParamLayout, mesh: Mesh, axes) -> PyTree:
    """:func:`opt_state_specs` as ``NamedSharding``s on ``mesh``."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        opt_state_specs(opt_state, params, layout, axes),
        is_leaf=lambda x: isinstance(x, P),
    )
