"""How a model reads its parameters: one interface for sharded and unsharded runs.

A model's loss function is written once against :class:`ParamAccess` and receives

* :class:`LocalParams` when it runs on one device on the plain parameter pytree (the reference,
  evaluation, a notebook), or
* ``qsdp_jax.train.ShardedParams`` inside the sharded train step, where ``gather`` performs the
  (quantized) all-gather of a group's weights and ``scan`` gathers one layer at a time inside a
  ``lax.scan`` so that peak memory holds a single layer's full weights.

Parameters are a dict of *groups*: ``{"embed": {...}, "blocks": {...}, ...}``. A group named in
``stacked`` holds layer-stacked leaves whose leading axis is the layer index.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
from jax import lax

PyTree = Any
# body(carry, layer_params, x) -> (carry, y)
ScanBody = Callable[[Any, PyTree, Any], tuple[Any, Any]]


class ParamAccess(Protocol):
    """What a loss function may do with its parameters."""

    def gather(self, group: str) -> PyTree:
        """The full (unsharded) parameters of a non-stacked group."""
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

        ``body(carry, layer_params, x)`` receives the full parameters of one layer (leading
        layer axis removed) and the matching slice of ``xs``; returns ``(carry, y)``.
        With ``remat=True`` the body is rematerialised in the backward pass (in the sharded
        step this re-gathers the layer instead of keeping its weights alive).
        """
        ...


class LocalParams:
    """:class:`ParamAccess` over a plain, unsharded parameter dict (one device, no comms)."""

    def __init__(self, params: dict[str, PyTree]):
        if not isinstance(params, dict):
            raise TypeError(
                f"params must be a dict of groups, got {type(params).__name__}"
            )
        self._params = params

    def gather(self, group: str) -> PyTree:
        return self._params[_check_group(self._params, group)]

    def scan(self, group, body, init, xs=None, *, remat=True):
        stacked = self._params[_check_group(self._params, group)]

        def step(carry, inputs):
            layer_params, x = inputs
            return body(carry, layer_params, x)

        if remat:
            step = jax.checkpoint(step)
        return lax.scan(step, init, (stacked, xs))


def _check_group(params: dict, group: str) -> str:
    if group not in params:
        raise KeyError(
            f"unknown parameter group {group!r}; groups are {sorted(params)}"
        )
    return group
