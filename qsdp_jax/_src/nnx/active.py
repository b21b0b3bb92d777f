"""Which sharded NNX step is being traced (:func:`current`), and walks of its module that read
no parameter (:func:`params_untouched`): shared by :mod:`qsdp_jax._src.nnx.scan` (the module
inside the step) and :mod:`qsdp_jax._src.nnx.reshard` (its resharded calls)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from flax import nnx

_ACTIVE = threading.local()  # .stack: the StepContexts being traced; .untouched: see below


@contextlib.contextmanager
def params_untouched():
    """Within: reading an ``nnx.Param`` of the step's module gathers nothing (for walks of the
    module graph that read every variable but use only the non-parameter ones)."""
    before = getattr(_ACTIVE, "untouched", False)
    _ACTIVE.untouched = True
    try:
        yield
    finally:
        _ACTIVE.untouched = before


def non_params(module) -> list:
    """``[(path, variable)]`` of ``module``'s non-parameter variables; gathers nothing."""
    with params_untouched():
        return list(nnx.to_flat_state(nnx.state(module, nnx.Not(nnx.Param))))


def current() -> Any:
    """The sharded step being traced, if any."""
    stack = getattr(_ACTIVE, "stack", [])
    return stack[-1] if stack else None
