"""How a model reads its parameters: one interface for sharded and unsharded runs.

A model's loss function is written once against :class:`ParamAccess` and receives

* :class:`LocalParams` when it runs on one device on the plain parameter pytree (the reference,
  evaluation, a notebook), or
* ``qsdp_jax.train.ShardedParams`` inside the sharded train step, where ``gather`` performs the
  (quantized) all-gather of a group's weights, ``call`` gathers them for one function call and
  again in its backward pass, ``scan`` gathers one layer at a time inside a ``lax.scan``, so
  that peak memory holds a single layer's full weights, and ``take`` reads rows of a table (an
  embedding lookup) from the devices' blocks without the table.

Parameters are a dict of *groups*: ``{"embed": {...}, "blocks": {...}, ...}``. A group named in
``stacked`` holds layer-stacked leaves whose leading axis is the layer index.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from qsdp_jax._src.layout import policy

PyTree = Any
# body(carry, layer_params, x) -> (carry, y)
ScanBody = Callable[[Any, PyTree, Any], tuple[Any, Any]]


class ParamAccess(Protocol):
    """What a loss function may do with its parameters.

    A ``typing.Protocol``: the loss receives :class:`LocalParams` on one device, or the sharded
    step's implementation (``qsdp_jax._src.step.sharded_access.ShardedParams``) inside
    ``qsdp_jax.make_train_step``; it never builds one itself.
    """

    def gather(self, group: str) -> PyTree:
        """The full (unsharded) parameters of a non-stacked group.

        In the sharded step this is the group's (quantized) all-gather; its backward
        reduce-scatters the gradient.

        Args:
          group: the group's name (a key of the params dict).

        Returns:
          The group's pytree, every leaf at its full shape.

        Raises:
          KeyError: no group of that name.
          ValueError: (sharded step) the group is layer-stacked: read it with :meth:`scan`.
        """
        ...

    def call(self, group: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(gather(group), *args)``, the group's weights freed after the call.

        In the sharded step the group is gathered for the call and gathered again in the
        backward pass, which re-runs ``fn`` to take its gradient (PyTorch FSDP2's
        ``reshard_after_forward``): peak memory holds one or two called groups' weights
        however many there are, for a second all-gather of each. :meth:`gather` keeps the
        weights alive until the backward pass instead.

        Args:
          group: a non-stacked group's name.
          fn: ``fn(group_params, *args) -> pytree of arrays``, a pure function.
          *args: its other inputs: pytrees of arrays (close over anything else).

        Returns:
          What ``fn`` returns.

        Raises:
          KeyError: no group of that name.
          ValueError: (sharded step) the group is layer-stacked: read it with :meth:`scan`.
        """
        ...

    def take(self, path: str, ids: jax.Array) -> jax.Array:
        """``jnp.take(leaf, ids, axis=0)`` of one leaf of a non-stacked group: the rows of an
        embedding table.

        In the sharded step the rows are read from the devices' blocks of the leaf: neither
        pass holds the whole table or a table-sized gradient, and the rows' gradient reaches the
        blocks exactly (float32), not through the table's reduce-scatter
        (``qsdp_jax._src.collective.sharded_take``). A table with no more rows than all the devices' ids
        together (a position table) is all-gathered alone, unquantized, instead. The rows are the weights as stored: in ``"qsdp"``
        mode (on the grid) and in float32 FSDP the bits :meth:`gather` gives; in ``"comm"``
        mode or with bfloat16 gathers, the weights before the gather's rounding. For a tied
        embedding, ``take`` the lookup and :meth:`gather` the table for the output projection
        only.

        Args:
          path: the leaf's path, ``"group/key/..."`` (``ParamLayout.leaf_paths()``).
          ids: integer ids, any shape (in the sharded step: this device's). Out-of-range ids
            give NaN rows and negative ones count from the end, as with ``jnp.take``.

        Returns:
          The rows, shape ``ids.shape + leaf.shape[1:]``.

        Raises:
          KeyError: no group or leaf of that path.
          TypeError: ``ids`` are not integers.
          ValueError: the group is layer-stacked, or the leaf is a scalar.
        """
        ...

    def scan(
        self,
        group: str,
        body: ScanBody,
        init: Any,
        xs: Any = None,
        *,
        remat: bool = True,
    ) -> tuple[Any, Any]:
        """``lax.scan`` over the layers of a stacked group.

        In the sharded step each iteration gathers one layer, so peak memory holds a single
        layer's full weights.

        Args:
          group: the name of a stacked group (named in ``stacked``).
          body: ``body(carry, layer_params, x) -> (carry, y)``; it receives the full parameters
            of one layer (leading layer axis removed) and the matching slice of ``xs``.
          init: the initial carry.
          xs: per-layer inputs scanned along their leading axis (one entry per layer), or None
            (the default): ``x`` is None.
          remat: rematerialise the body in the backward pass (the default; in the sharded step
            this re-gathers the layer instead of keeping its weights alive).

        Returns:
          ``(carry, ys)`` as ``lax.scan`` returns them, the final carry and the stacked ``y``.

        Raises:
          KeyError: no group of that name.
          ValueError: (sharded step) the group is not layer-stacked: read it with
            :meth:`gather`.
        """
        ...


class LocalParams:
    """:class:`ParamAccess` over a plain, unsharded parameter dict (one device, no comms).

    Args:
      params: the parameter dict of groups (stacked groups with their leading layer axis).

    Raises:
      TypeError: ``params`` is not a dict.
    """

    def __init__(self, params: dict[str, PyTree]):
        if not isinstance(params, dict):
            raise TypeError(f"params must be a dict of groups, got {type(params).__name__}")
        self._params = params

    def gather(self, group: str) -> PyTree:
        """The parameters of ``group`` as they are in the dict (no copy, no communication).

        Args:
          group: the group's name.

        Returns:
          The group's pytree (a stacked group's too; nothing is checked about stacking here).

        Raises:
          KeyError: no group of that name.
        """
        return self._params[_check_group(self._params, group)]

    def call(self, group: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(gather(group), *args)`` (nothing to free on one device).

        Args:
          group: the group's name.
          fn: ``fn(group_params, *args)``.
          *args: its other inputs.

        Returns:
          What ``fn`` returns.

        Raises:
          KeyError: no group of that name.
        """
        return fn(self.gather(group), *args)

    def take(self, path: str, ids: jax.Array) -> jax.Array:
        """``jnp.take(leaf, ids, axis=0)`` of the leaf at ``path`` (:meth:`ParamAccess.take`).

        Raises:
          KeyError: no group or leaf of that path.
          TypeError: ``ids`` are not integers.
          ValueError: the leaf is a scalar.
        """
        group = _check_group(self._params, path.split("/")[0])
        leaf = leaf_at(self._params[group], group, path)
        check_take(path, jnp.ndim(leaf), ids)
        return jnp.take(leaf, ids, axis=0)

    def scan(self, group, body, init, xs=None, *, remat=True):
        """``lax.scan`` of ``body`` over the leading (layer) axis of ``group``'s leaves.

        Args:
          group: the name of a stacked group.
          body: ``body(carry, layer_params, x) -> (carry, y)``, as in :meth:`ParamAccess.scan`.
          init: the initial carry.
          xs: per-layer inputs (leading axis: the layers), or None.
          remat: wrap the body in ``jax.checkpoint`` (default True).

        Returns:
          ``(carry, ys)`` from ``lax.scan``.

        Raises:
          KeyError: no group of that name.
        """
        stacked = self._params[_check_group(self._params, group)]

        def step(carry, inputs):
            layer_params, x = inputs
            return body(carry, layer_params, x)

        if remat:
            step = jax.checkpoint(step)
        return lax.scan(step, init, (stacked, xs))


def leaf_at(tree: PyTree, group: str, path: str) -> Any:
    """The leaf of ``group``'s ``tree`` at ``path`` (``"group/key/..."``).

    Raises:
      KeyError: no leaf of that path, naming the group's paths.
    """
    paths = policy.tree_paths(group, tree)
    if path not in paths:
        raise KeyError(f"no leaf {path!r} in group {group!r}; its leaves are {paths}")
    return jax.tree_util.tree_leaves(tree)[paths.index(path)]


def check_take(path: str, ndim: int, ids) -> None:
    """``TypeError`` for non-integer ``ids``; ``ValueError`` for a scalar leaf."""
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise TypeError(f"take({path!r}): ids must be integers, got {jnp.result_type(ids)}")
    if ndim == 0:
        raise ValueError(f"take({path!r}): the leaf is a scalar; take reads rows of a table")


def _check_group(params: dict, group: str) -> str:
    if group not in params:
        raise KeyError(f"unknown parameter group {group!r}; groups are {sorted(params)}")
    return group
