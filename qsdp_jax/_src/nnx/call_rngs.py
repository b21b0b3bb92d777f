"""RNG streams passed to ``loss_fn`` for the call, as NNX documents it for dropout:
``model(x, rngs=rngs)`` with ``nnx.Dropout(rate)`` built without rngs.

``q.nnx.make_train_step(..., rngs=nnx.Rngs(dropout=0))`` makes the step call
``loss_fn(model, batch, rngs=step_rngs)``: an ``nnx.Rngs`` made inside the step's trace whose
streams are the given ones with every key folded with the step and the device (as the module's
own streams are, :func:`qsdp_jax._src.nnx.scan.fold_keys`). Each step and device draws fresh
masks, a pure function of (keys, step, device): a resumed run draws what the uninterrupted one did.

An ``nnx.Rngs`` made outside the step and used inside it (a closure) cannot advance there: flax
raises ``TraceContextError`` ("Cannot mutate RngCount from a different trace level"), which
:func:`closure_error` turns into a message naming this way out.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax import lax

from qsdp_jax._src.nnx.scan import fold_keys


class CallRngs:
    """The streams of the ``nnx.Rngs`` given to ``make_train_step(rngs=...)``.

    Args:
      rngs: an ``nnx.Rngs`` (its streams' current keys are read; it is not advanced).
    """

    def __init__(self, rngs):
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs (e.g. nnx.Rngs(dropout=0)), got {type(rngs).__name__}")
        self.streams = []
        for name, stream in rngs.items():
            key = stream.key.get_raw_value()
            self.streams.append((name, jax.random.key_data(key), jax.random.key_impl(key)))

    def for_step(self, step, axis) -> nnx.Rngs:
        """The ``nnx.Rngs`` of this step on this device (inside the step's ``shard_map``)."""
        device = lax.axis_index(axis)
        keys = {
            name: fold_keys(jax.random.wrap_key_data(data, impl=impl), step, device)
            for name, data, impl in self.streams
        }
        return nnx.Rngs(**keys)


def closure_error(e: Exception) -> ValueError:
    """The error for an outer ``nnx.Rngs`` used inside the step (flax's TraceContextError)."""
    return ValueError(
        f"the loss used an nnx.Rngs (or another NNX object) made outside the step, which cannot "
        f"change inside it ({type(e).__name__}: {str(e).splitlines()[0]}). For dropout with rngs "
        "passed to __call__, give the streams to the step, make_train_step(..., rngs=nnx.Rngs(dropout=0)), "
        "and take them as loss_fn(model, batch, rngs): each step and device then draws fresh keys; "
        "or give the module its own rngs (nnx.Dropout(rate, rngs=rngs))"
    )
