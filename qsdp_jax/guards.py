"""Guards against silent wrong results and crashes at the edges of the train step.

* :func:`check_params`: non-float leaves, NaN/Inf at init and ``stacked`` given as a string are
  clear errors (they used to fail deep inside JAX, or train on NaN);
* :func:`warn_padding`: a bucket far larger than the leaves multiplies the memory silently;
* :class:`CheckedStep`: calling a step with a state donated to an earlier call is a Python error
  (it could segfault).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from qsdp_jax.config import QSDPConfig
from qsdp_jax.sharding import ParamLayout


def check_params(params, stacked) -> None:
    """Clear errors for what would fail deep inside JAX or train silently wrong: ``stacked``
    given as a string, non-float leaves, NaN/Inf values (concrete params only)."""
    if isinstance(stacked, str):
        raise TypeError(
            f"stacked must be a sequence of group names, e.g. ({stacked!r},), got the string {stacked!r}"
        )
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"parameter {name} has dtype {dtype}: parameters must be floating point (keep "
                "integer or boolean constants out of the params dict, e.g. in the loss's closure)"
            )
        if isinstance(x, (jax.ShapeDtypeStruct, jax.core.Tracer)):
            continue
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            continue  # spread over processes: checking it would need a collective
        try:
            finite = bool(jnp.all(jnp.isfinite(jnp.asarray(x))))
        except jax.errors.ConcretizationTypeError:  # inside a trace (e.g. eval_shape): no values
            continue
        if not finite:
            raise ValueError(f"parameter {name} holds NaN or Inf values at init")


def check_not_donated(state) -> None:
    """A Python error instead of a crash when a state whose buffers were donated is used again."""
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
            raise RuntimeError(
                f"the train state's {jax.tree_util.keystr(path)} was deleted: this state was "
                "donated to an earlier step call (donate=True). Use the state that call returned, "
                "or build the step with donate=False to keep inputs alive"
            )


class CheckedStep:
    """A jitted step that first checks its state was not donated; forwards ``lower`` etc."""

    def __init__(self, jitted):
        self._jitted = jitted

    def __call__(self, state, *args, **kwargs):
        check_not_donated(state)
        return self._jitted(state, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


PADDING_WARN_RATIO = 32


def warn_padding(layout: ParamLayout, config: QSDPConfig) -> None:
    """Warn when whole-bucket padding makes the sharded buffers far larger than the leaves."""
    real = sum(g.real_size * max(g.n_layers, 1) for g in layout.groups)
    held = sum(g.held_size * max(g.n_layers, 1) for g in layout.groups)
    if real and held > PADDING_WARN_RATIO * real and held - real > 65536:
        warnings.warn(
            f"QSDPConfig.bucket_size={config.bucket_size} on {layout.num_shards} devices pads "
            f"{real:,} sharded parameters to {held:,} elements ({held / real:.0f}x the memory and "
            "bandwidth): use a smaller bucket_size or a larger min_shard_size",
            stacklevel=3,
        )
