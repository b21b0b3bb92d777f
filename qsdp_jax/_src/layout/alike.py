"""Alike arrays kept apart, read by one compiled loop body (``layer_scan.remat_scan(apart=True)``).

XLA:CPU compiles one kernel per distinct fusion: kernels that differ in one constant (a layer's
slice offset) are all distinct. Here:

* :func:`pick`: item ``i`` (traced) of a list of alike pytrees, through a ``lax.switch`` whose
  branches return one item each: no stacked copy of the list is made.
* :func:`apart`: the items of stacked arrays as separate values, each a dynamic slice at an
  index XLA cannot see (written out behind ``cpu_boundary``), so each item's consumers compile
  to the same kernels whatever the item.
* :func:`opaque_ints`: integers as scalars XLA cannot see, for per-item integers (a
  leaf's key) that would otherwise be a constant folded into each item's kernels.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
from jax import lax

from qsdp_jax._src.quant.payload import cpu_boundary


def pick(items: Sequence[Any], i) -> Any:
    """``items[i]`` for a traced ``i`` (one ``lax.switch`` branch per item)."""
    return lax.switch(i, [lambda k=k: items[k] for k in range(len(items))])


def opaque_ints(values: Sequence[int], data) -> list:
    """``values`` as int32 scalars that XLA:CPU cannot fold: one conditional (behind
    ``cpu_boundary``, its predicate read from ``data``, a traced array) returns them. A key
    derived from ``(..., i)`` with a constant ``i`` is one distinct kernel per ``i`` on XLA:CPU
    (108 of the 515 distinct kernels of Gemma 3 270M's W8G8 step); from an opaque ``i``, one."""
    if not values:
        return []
    return list(cpu_boundary(lambda _: [jnp.int32(v) for v in values], data))


def apart(stacked: list, n: int) -> list[list]:
    """The ``n`` items of the arrays ``stacked`` (leading axis ``n``), a list over the items
    of lists over the arrays (see the module docstring)."""
    index = cpu_boundary(lambda a: [a[i] for i in range(n)], jnp.arange(n, dtype=jnp.int32))
    return [[lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in stacked] for i in index]
