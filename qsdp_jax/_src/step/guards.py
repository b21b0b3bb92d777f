"""Guards against silent wrong results and crashes at the edges of the train step.

* :func:`check_params`: non-float leaves, NaN/Inf at init and ``stacked`` given as a string are
  clear errors (they used to fail deep inside JAX, or train on NaN);
* :func:`warn_padding`: a bucket far larger than the leaves multiplies the memory silently;
* :class:`CheckedStep`: calling a step with a state donated to an earlier call is a Python error
  (it could segfault); a Pallas kernel that the compiler refuses is named, with the way out;
* :func:`check_mesh`: a state placed on another mesh than the step's is a clear error;
* :func:`check_batch`: an empty batch, a scalar leaf or a batch that does not split over the
  devices is a clear error.

The checks name what they find through a ``label`` function of the leaf's key path, so the
Flax NNX front door (``qsdp_jax.nnx``) reports module paths and ``nnx.Param`` where the
``ParamAccess`` API reports keys of its params dict.
"""

from __future__ import annotations

import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from qsdp_jax.config import QSDPConfig
from qsdp_jax.kernels.compile_errors import kernel_failures_explained
from qsdp_jax.layout import ParamLayout

DICT_INT_HINT = "keep integer or boolean constants out of the params dict, e.g. in the loss's closure"


def _param_label(path) -> str:
    return f"parameter {jax.tree_util.keystr(path)}"


def _state_label(path) -> str:
    return f"train state's {jax.tree_util.keystr(path)}"


def check_stacked(stacked) -> None:
    """``stacked`` given as a string (a common slip for a one-group tuple) is a clear error."""
    if isinstance(stacked, str):
        raise TypeError(f"stacked must be a sequence of group names, e.g. ({stacked!r},), got the string {stacked!r}")


def check_params(params, stacked, *, label: Callable = _param_label, int_hint: str = DICT_INT_HINT) -> None:
    """Clear errors for what would fail deep inside JAX or train silently wrong: ``stacked``
    given as a string, non-float leaves, NaN/Inf values (concrete params only).

    Args:
      params: the parameter pytree.
      stacked: the stacked group names.
      label: names a leaf in the messages, from its key path.
      int_hint: where to keep integer or boolean arrays instead, for the dtype error.
    """
    check_stacked(stacked)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = label(path)
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{name} has dtype {dtype}: parameters must be floating point ({int_hint})")
        if isinstance(x, (jax.ShapeDtypeStruct, jax.core.Tracer)):
            continue
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            continue  # spread over processes: checking it would need a collective
        try:
            finite = bool(jnp.all(jnp.isfinite(jnp.asarray(x))))
        except jax.errors.ConcretizationTypeError:  # inside a trace (e.g. eval_shape): no values
            continue
        if not finite:
            raise ValueError(f"{name} holds NaN or Inf values at init")


def check_not_donated(state, label: Callable = _state_label) -> None:
    """A Python error instead of a crash when a state whose buffers were donated is used again
    (``label`` names the leaf from its key path)."""
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
            raise RuntimeError(
                f"the {label(path)} was deleted: this state was donated to an earlier step call "
                "(donate=True). Use the state that call returned, or build the step with "
                "donate=False to keep inputs alive"
            )


class CheckedStep:
    """A jitted step that first checks its state was not donated and lies on the step's mesh,
    and says which kernel a
    compiler refused (``kernels.compile_errors``); forwards ``lower`` etc."""

    def __init__(self, jitted, mesh: Mesh):
        self._jitted = jitted
        self._mesh = mesh
        self._device_kind = mesh.devices.flat[0].device_kind

    def __call__(self, state, *args, **kwargs):
        check_not_donated(state)
        check_mesh(state, self._mesh)  # not JAX's reshape error from deep inside the step
        with kernel_failures_explained(self._device_kind):
            return self._jitted(state, *args, **kwargs)

    # Explicit, not only forwarded: from jax 0.11 ``jax.export`` accepts only a
    # ``stages.Wrapped``, a protocol checked by these methods' presence on the class.
    def trace(self, *args, **kwargs):
        return self._jitted.trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


def describe_mesh(mesh: Mesh) -> str:
    """``"{'fsdp': 8} (8 devices: 0, 1, ...)"``: a mesh's axes and devices, for messages."""
    ids = [d.id for d in mesh.devices.flat]
    shown = ", ".join(map(str, ids[:16])) + (", ..." if len(ids) > 16 else "")
    return f"{dict(mesh.shape)} ({len(ids)} devices: {shown})"


def check_mesh(arrays, mesh: Mesh, label: Callable = _state_label) -> None:
    """A clear error when an array of ``arrays`` (a pytree) lies on another mesh than ``mesh``
    (the step's); arrays placed otherwise than by a ``NamedSharding`` are not checked."""
    for path, x in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            continue
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and sharding.mesh is not mesh and sharding.mesh != mesh:
            theirs = sharding.mesh
            assert isinstance(theirs, Mesh)  # a concrete array's mesh has devices (not abstract)
            raise ValueError(
                f"the {label(path)} lies on the mesh {describe_mesh(theirs)} but this step "
                f"was built for the mesh {describe_mesh(mesh)}: make the state on the step's mesh, "
                "or restore a checkpoint of it onto that mesh (qsdp_jax.checkpoint reshards)"
            )


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


def check_batch(batch, n: int):
    """A clear error for a batch the step cannot split over ``n`` devices."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("the batch is empty")
    sizes = {x.shape[0] for x in leaves if x.ndim}
    if len(sizes) > 1:
        raise ValueError(
            f"batch leaves have different leading (batch) sizes {sorted(sizes)}: every leaf must hold the same examples"
        )
    for x in leaves:
        if x.ndim == 0:
            raise ValueError("every batch leaf needs a leading batch axis; got a scalar")
        if x.shape[0] % n:
            raise ValueError(
                f"the global batch of {x.shape[0]} examples does not divide over {n} devices: use a multiple of {n}"
            )
