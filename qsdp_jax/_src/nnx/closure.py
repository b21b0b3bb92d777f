"""A loss that closes over the module instead of using the one it is given, caught while the step
traces.

``loss_fn(model, batch)`` gets a module whose parameters are the state's weights, gathered. A
loss written ``lambda m, batch: loss(model(batch["x"]), ...)`` (``model``, not ``m``) reads the
module the step was built from: its arrays become constants of the compiled step, no gradient
reaches the state and the run trains nothing, silently. While the step traces ``loss_fn``, the
parameters of that module stand in as :class:`_ClosedOver` values, which raise a ``ValueError``
naming the parameter the moment the loss computes with one; the module gets its arrays back
when the trace ends (or fails). Another module (a teacher, an ``nnx.clone`` kept as an anchor)
is not touched.
"""

from __future__ import annotations

import contextlib
import threading

from flax import nnx

from qsdp_jax._src.nnx.tree import path_str

_ACTIVE = threading.local()  # ids of the modules stood in for now (nested traces re-enter)


def _message(path: str) -> str:
    return (
        f"loss_fn computed with the parameter {path!r} of the module the step was built from (a "
        "closure over that module) instead of the module it is given: that module holds the "
        "weights of its last qsdp_jax.nnx.update, not the state's, and no gradient would reach "
        "the state. Write loss_fn(model, batch) in terms of its model argument; for fixed weights "
        "(a teacher, an anchor) close over nnx.clone(model)."
    )


class _ClosedOver:
    """Stands in for a parameter of the step's module while ``loss_fn`` traces: its shape and
    dtype read as the parameter's, any computation with it raises the closure's error."""

    def __init__(self, path: str, value):
        self._path = path
        self.shape, self.dtype = getattr(value, "shape", ()), getattr(value, "dtype", None)
        self.ndim = len(self.shape)

    def _fail(self, *args, **kwargs):
        raise ValueError(_message(self._path))

    def __getattr__(self, name):
        self._fail()


_OPS = (
    "__jax_array__ __array__ __getitem__ __iter__ __len__ __bool__ __float__ __int__ __index__ "
    "__neg__ __pos__ __abs__ __invert__ __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ "
    "__matmul__ __rmatmul__ __truediv__ __rtruediv__ __floordiv__ __rfloordiv__ __mod__ __rmod__ "
    "__pow__ __rpow__ __lt__ __le__ __gt__ __ge__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__"
).split()
for _name in _OPS:
    setattr(_ClosedOver, _name, _ClosedOver._fail)


def _put(var: nnx.Variable, value) -> None:
    # flax refuses to set a variable created outside the trace under way (its trace-level
    # check, in Variable.__setattr__ too); this one is set back before the trace ends and never
    # holds a tracer, so its value is written past the check (flax 0.12's attribute)
    object.__setattr__(var, "_raw_value", value)


@contextlib.contextmanager
def stand_in(model: nnx.Module):
    """While the block runs, ``model``'s ``nnx.Param`` values are :class:`_ClosedOver`; restored
    afterwards whatever happens. Re-entrant (a trace inside a trace of the same module)."""
    active = getattr(_ACTIVE, "ids", None)
    if active is None:
        active = _ACTIVE.ids = set()
    if id(model) in active:
        yield
        return
    params, seen = [], set()
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and id(var) not in seen:  # a shared (tied) one once
            seen.add(id(var))
            params.append((path, var))
    saved = [var.get_raw_value() for _, var in params]
    active.add(id(model))
    try:
        for (path, var), value in zip(params, saved, strict=True):
            _put(var, _ClosedOver(path_str(path), value))
        yield
    finally:
        for (_, var), value in zip(params, saved, strict=True):
            _put(var, value)
        active.discard(id(model))
