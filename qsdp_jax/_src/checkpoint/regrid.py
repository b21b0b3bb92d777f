"""Moving a restored QSDP state onto the weight grid of another mesh (``restore(regrid=True)``).

A weight grid's buckets live inside one device's shard (``qsdp_jax.layout``). Where a leaf's
shard is whole buckets of its row-major order the buckets are the same on every device count and
a checkpoint reshards exactly; otherwise the stored grid belongs to the old mesh. Then the
restored weights are re-projected onto a grid of the new mesh's buckets by round to nearest:
each weight moves by at most half a grid step, and from there the gather is lossless again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax.sharding import Mesh

from qsdp_jax._src.quant import grid as qgrid
from qsdp_jax import optim as qoptim
from qsdp_jax.config import QSDPConfig


def grid_leaf_keys(state, paths: Sequence[str]) -> set[str]:
    """The ``keystr`` of the scales and offsets leaves of the leaves at ``paths`` (policy
    paths, e.g. ``"head/w"``) in ``state``'s QSDPState."""
    wanted = set(paths)
    hits = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, qoptim.QSDPState))[0]
    out = set()
    for path, node in hits:
        if not isinstance(node, qoptim.QSDPState):
            continue
        prefix = jax.tree_util.keystr(path)
        for (g, x), (sub, _) in zip(state.layout.leaves(), jax.tree_util.tree_flatten_with_path(node.scales)[0]):
            if x.path in wanted:
                out |= {f"{prefix}.scales{jax.tree_util.keystr(sub)}", f"{prefix}.offsets{jax.tree_util.keystr(sub)}"}
    return out


def regrid(state, paths: Sequence[str], config: QSDPConfig, mesh: Mesh):
    """``state`` with the leaves at ``paths`` re-projected (round to nearest) onto fresh grids
    of ``state``'s layout, their grids replaced; everything else unchanged."""
    layout, wanted = state.layout, set(paths)

    def fn(params, opt_state):
        with qgrid.layout_context(layout, mesh, config.shard_axes):
            treedef: Any  # a PyTreeDef: jaxlib ships no stubs for it, so a checker sees no methods
            leaves, treedef = jax.tree_util.tree_flatten(params)
            geos = [
                g if x.path in wanted else dataclasses.replace(g, bits=None)
                for g, (_, x) in zip(qgrid.geometries(params, config), layout.leaves())
            ]
            st = qoptim.find_qsdp_state(opt_state)
            assert st is not None  # grids (hence moved ones) exist only with a QSDPState
            values, scales, offsets = qgrid.project(leaves, geos, config, st.count, rounding="nearest")
        pick = lambda new, old: [
            o if n is None or g.bits is None else n  # noqa: E731
            for n, o, g in zip(new, old, geos)
        ]
        params = jax.tree_util.tree_unflatten(treedef, pick(values, leaves))
        st = dataclasses.replace(
            st,
            scales=jax.tree_util.tree_unflatten(treedef, pick(scales, treedef.flatten_up_to(st.scales))),
            offsets=jax.tree_util.tree_unflatten(treedef, pick(offsets, treedef.flatten_up_to(st.offsets))),
        )
        opt_state = jax.tree.map(
            lambda x: st if isinstance(x, qoptim.QSDPState) else x,
            opt_state,
            is_leaf=lambda x: isinstance(x, qoptim.QSDPState),
        )
        return params, opt_state

    shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
    params, opt_state = jax.jit(fn, out_shardings=shardings)(state.params, state.opt_state)
    return dataclasses.replace(state, params=params, opt_state=opt_state)
