"""Embedding lookups as rows in the NNX front door (``make_train_step(..., take_embeddings=True)``).

Inside the step every ``nnx.Embed`` of a non-stacked group has a ``__call__`` that reads the
looked-up rows with ``ParamAccess.take`` (``qsdp_jax._src.collective.sharded_take``) instead of reading its
table, which would gather the table's whole group: no device holds the whole table for the
lookup, and its gradient reaches the devices' blocks exactly. Reading the table otherwise (a
tied embedding's ``attend``) still gathers the group, for that use alone.

Only ``nnx.Embed`` and its subclasses that keep its ``__call__`` are changed: a subclass with a
``__call__`` of its own (which may do more than the lookup) reads its table as before. A call
runs plain (reading the table) when it is given ``out_sharding``, when the table has one
row, when the ids are not integers (``nnx.Embed``'s own error), and anywhere but at the loss's
own trace level: inside an NNX transform (``nnx.remat``, ``nnx.vmap``: the transform reads the
group's state, which gathers it) or inside a resharded call of a group holding other weights
too, which gathers the table with them for the call anyway (rows would be bytes on top).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from qsdp_jax._src.nnx.active import current
from qsdp_jax._src.nnx.tree import Group, ModelDef

_CLASSES: dict[type, type] = {}


def install(module: nnx.Module, mdef: ModelDef) -> dict[int, tuple[str, str]]:
    """Give every ``nnx.Embed`` in ``module`` (with ``nnx.Embed``'s own ``__call__``) whose table
    is a parameter of a non-stacked group the taking ``__call__``; returns ``{id(embed): (group
    name, leaf path)}`` of them (the path as ``ParamAccess.take`` reads it)."""
    out = {}
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Embed) or type(node).__call__ is not nnx.Embed.__call__:
            continue
        where = (*path, "embedding")
        g = mdef.group_of(where)
        if g is None or g.stacked:
            continue
        out[id(node)] = (g.name, _leaf_path(g, where))
        object.__setattr__(node, "__class__", taking_class(type(node)))
    return out


def only_tables(group_name: str, mdef: ModelDef, taken: dict[int, tuple[str, str]]) -> bool:
    """Every parameter of the group is a taken table: nothing of it is gathered for a call."""
    paths = {path for name, path in taken.values() if name == group_name}
    g = next(g for g in mdef.groups if g.name == group_name)
    mine = [_leaf_path(g, s.path) for s in mdef.params if mdef.group_of(s.path) is g]
    return bool(mine) and set(mine) <= paths


def _leaf_path(g: Group, path: tuple) -> str:
    """The ``ParamAccess`` path (``"group/key/..."``) of the variable at module ``path`` in ``g``."""
    return "/".join([g.name, *map(str, path[len(g.path) :])])


def taking_class(cls: type) -> type:
    """The subclass of an ``nnx.Embed`` class whose ``__call__`` takes rows (one per class)."""
    sub = _CLASSES.get(cls)
    if sub is None:
        orig = cls.__call__

        def __call__(self, inputs: Any, out_sharding=None):
            ctx = current()
            taken = None if ctx is None else ctx.taken.get(id(self))
            if taken is None or out_sharding is not None or self.num_embeddings == 1 or not ctx.at_base_level():
                return orig(self, inputs, out_sharding=out_sharding)
            if not jnp.issubdtype(jnp.result_type(inputs), jnp.integer):
                return orig(self, inputs, out_sharding=out_sharding)  # nnx.Embed's own error
            group, path = taken
            ctx.record.setdefault(group, "rows")
            (rows,) = self.promote_dtype((ctx.access.take(path, inputs),), dtype=self.dtype, inexact=False)
            return rows

        sub = type(cls)(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
        sub.__qualname__ = cls.__qualname__
        _CLASSES[cls] = sub
    return sub
