"""One computation over many alike arrays, compiled once, without stacking them.

XLA compiles every copy of a computation the program holds, and XLA:CPU one kernel per distinct
fusion: the same projection onto the grid for 109 leaves of six shapes is 109 copies, and kernels
that differ in one constant (a leaf index, a layer's slice offset) are all distinct. Here:

* :func:`pick`: item ``i`` (traced) of a list of alike pytrees, through a ``lax.switch`` whose
  branches return one item each: no stacked copy of the list is made.
* :func:`apart`: the items of stacked arrays as separate values, each a dynamic slice at an
  index XLA cannot see (written out behind ``cpu_boundary``), so each item's consumers compile
  to the same kernels whatever the item.
* :func:`map_alike`: ``fn(i, rep, *items_i)`` for every ``i``, the items of equal key run by
  one ``lax.scan`` (``fn`` traced and compiled once per key); outputs come back apart.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from qsdp_jax._src.payload import cpu_boundary


def pick(items: Sequence[Any], i) -> Any:
    """``items[i]`` for a traced ``i`` (one ``lax.switch`` branch per item)."""
    return lax.switch(i, [lambda k=k: items[k] for k in range(len(items))])


def apart(stacked: list, n: int) -> list[list]:
    """The ``n`` items of the arrays ``stacked`` (leading axis ``n``), a list over the items
    of lists over the arrays (see the module docstring)."""
    index = cpu_boundary(lambda a: [a[i] for i in range(n)], jnp.arange(n, dtype=jnp.int32))
    return [[lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in stacked] for i in index]


def map_alike(fn: Callable[..., Any], keys: Sequence[Hashable], *lists: Sequence[Any], single=None) -> list:
    """``[fn(i, i, *[items[i] for items in lists]) for i in range(len(keys))]`` with the items
    of equal ``keys`` computed by one ``lax.scan``: ``fn(i, rep, *items)`` then gets ``i``
    traced (an int32) and ``rep``, the first index of its key, static (for what the items of a
    key share, e.g. their geometry); alike items have the same shapes and dtypes.
    ``single(i, rep, *items)`` computes an item alone in its key (default ``fn``)."""
    single = fn if single is None else single
    out: list = [None] * len(keys)
    members: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)
    for idx in members.values():
        items = [[xs[i] for xs in lists] for i in idx]
        if len(idx) == 1:
            out[idx[0]] = single(idx[0], idx[0], *items[0])
            continue

        def body(_, t, items=items, rep=idx[0]):
            m, i = t
            return None, fn(i, rep, *pick(items, m))

        _, ys = lax.scan(body, None, (jnp.arange(len(idx), dtype=jnp.int32), jnp.asarray(idx, jnp.int32)))
        flat, tree = jax.tree_util.tree_flatten(ys)
        for i, parts in zip(idx, apart(flat, len(idx))):
            out[i] = jax.tree_util.tree_unflatten(tree, parts)
    return out
