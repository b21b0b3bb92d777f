"""Alike arrays kept apart, read by one compiled loop body (``layer_scan.remat_scan(apart=True)``).

XLA:CPU compiles one kernel per distinct fusion: kernels that differ in one constant (a layer's
slice offset) are all distinct. Here:

* :func:`pick`: item ``i`` (traced) of a list of alike pytrees, through a ``lax.switch`` whose
  branches return one item each: no stacked copy of the list is made.
* :func:`apart`: the items of stacked arrays as separate values, each a dynamic slice at an
  index XLA cannot see (written out behind ``cpu_boundary``), so each item's consumers compile
  to the same kernels whatever the item.
"""

from __future__ import annotations

from typing import Any, Sequence

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
