"""Sharding annotations inside the step: one rule.

Inside the FSDP step every mesh axis is manual (each device computes on its rows of the batch
with the weights the step gathered), so an annotation that places an array on the mesh has
nothing to say there, and JAX refuses one (``NotImplementedError: Going from Manual AxisType to
Auto or Explicit AxisType is not allowed``, from inside flax's ``nnx.Embed``). The rule:

* the ``out_sharding`` arguments of flax's layers (``nnx.Linear``, ``nnx.Embed`` and its
  ``attend``, ``nnx.Einsum``, ``nnx.LinearGeneral``, ``nnx.Conv``: any method of a module in the
  model that takes ``out_sharding``) are **ignored** in the step: :func:`ignore_out_sharding`
  gives the modules of the step's copy of the model a subclass whose method passes
  ``out_sharding=None``;
* parameter metadata (``nnx.with_partitioning``, a ``ShardingConfig``'s specs) stays metadata:
  the step lays every parameter out itself (``ParamLayout``);
* any other annotation the model makes itself (``jax.lax.with_sharding_constraint``,
  ``jax.sharding.reshard``, ``out_sharding=`` of a ``jnp`` call) is an error naming this rule
  (:func:`explain_manual_error`).

The module the user holds is not touched (the step runs a copy of its graph).
"""

from __future__ import annotations

import functools
import inspect

from flax import nnx

METHODS = ("__call__", "attend")
_CLASSES: dict[type, type | None] = {}


def _methods_with_out_sharding(cls: type) -> tuple[str, ...]:
    out = []
    for name in METHODS:
        fn = getattr(cls, name, None)
        if fn is None:
            continue
        try:
            if "out_sharding" in inspect.signature(fn).parameters:
                out.append(name)
        except (TypeError, ValueError):  # no signature to read: leave it
            continue
    return tuple(out)


def _dropping(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def method(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.arguments["out_sharding"] = None  # the step places arrays itself (module docstring)
        return orig(*bound.args, **bound.kwargs)

    return method


def _ignoring_class(cls: type) -> type | None:
    if cls not in _CLASSES:
        names = _methods_with_out_sharding(cls)
        sub = None
        if names:
            body = {n: _dropping(getattr(cls, n)) for n in names}
            sub = type(cls)(cls.__name__, (cls,), {**body, "__module__": cls.__module__})
            sub.__qualname__ = cls.__qualname__
            _CLASSES[sub] = None  # already ignoring: never wrapped twice
        _CLASSES[cls] = sub
    return _CLASSES[cls]


def ignore_out_sharding(module: nnx.Module) -> None:
    """Give every module of ``module`` (the step's copy) whose methods take ``out_sharding`` a
    subclass that ignores it."""
    for _, m in nnx.iter_modules(module):
        sub = _ignoring_class(type(m))
        if sub is not None:
            object.__setattr__(m, "__class__", sub)


# What JAX says when an annotation meets the step's manual axes (0.10: auto_axes / out_sharding,
# then with_sharding_constraint / reshard).
_MANUAL_MARKERS = ("Going from `Manual` AxisType", "can only refer to Auto axes of the mesh")


def is_manual_error(e: Exception) -> bool:
    return isinstance(e, (NotImplementedError, ValueError)) and any(m in str(e) for m in _MANUAL_MARKERS)


def explain_manual_error(e: Exception) -> ValueError:
    """A model's own sharding annotation refused inside the step: the rule, not JAX's words."""
    return ValueError(
        "the model places an array on the mesh inside the step (jax.lax.with_sharding_constraint, "
        "jax.sharding.reshard or auto_axes, or out_sharding= of a jnp call), which the FSDP step "
        "cannot honour: every mesh axis is manual there. The step ignores the out_sharding "
        "arguments of flax's layers and lays out the parameters itself; remove the model's own "
        f"annotations, or make them conditional (JAX said: {str(e).splitlines()[0]})"
    )
