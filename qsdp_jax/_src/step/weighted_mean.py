"""A loss normalised by a count of its batch (real tokens, a mask's sum, example weights) made
global: the objective it has on one device, whatever each device's share of the count.

A language-model loss divides the summed token losses by the number of real (non-pad) tokens of
the batch. Written as a mean over the local batch, each device divides by its own rows' count and
the step averages those means: with rows padded to different lengths that is another objective
(step 0 of the Flax Gemma example: 12.7029 against 12.7990 on one device; up to 1.4% off later).
Returned as :class:`WeightedMean` ``(total, weight)``, the step sums both over the devices and
trains ``sum(total) / sum(weight)``: each device's objective is ``total * n / W`` with ``W`` the
global weight (held constant), so the mean over devices the step takes of the gradients is the
gradient of the global objective, and the ``loss`` metric is the global weighted mean.

A plain scalar loss stays the mean of the devices' means (exact and cheap for equal-size local
batches). When the batch holds a leaf that looks like a mask or weights (a boolean leaf, or a
name with ``mask`` or ``weights`` in it) and the loss is a plain scalar, the step warns once per
trace (:class:`LocalMeanWarning`): it cannot see how the loss normalises.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["LocalMeanWarning", "WeightedMean"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WeightedMean:
    """A loss as ``total / weight`` over the *global* batch; return it from ``loss_fn``.

    Args:
      total: the sum over this batch of each loss term times its weight, e.g.
        ``jnp.sum(token_loss * mask)``.
      weight: the sum of the weights, e.g. ``jnp.sum(mask)`` (real tokens).

    On one device (outside the step) :attr:`value` is the loss.
    """

    total: jax.Array
    weight: jax.Array

    @property
    def value(self) -> jax.Array:
        """``total / weight`` (0 when the weight is 0)."""
        return _ratio(self.total, self.weight)


class LocalMeanWarning(UserWarning):
    """A plain scalar loss over a batch that holds a mask or weights: the step averages the
    devices' own means, which is not the one-device objective if the loss divides by a count
    of its batch. Return :class:`WeightedMean` instead, or filter this warning."""


def _ratio(total, weight):
    weight = jnp.asarray(weight, jnp.result_type(total))
    return total / jnp.where(weight == 0, 1, weight)


def check_weighted(loss: WeightedMean) -> None:
    """A clear error for fields that are not floating-point scalars."""
    for name in ("total", "weight"):
        x = getattr(loss, name)
        if not hasattr(x, "dtype") or jnp.shape(x) != () or not jnp.issubdtype(jnp.result_type(x), jnp.number):
            raise ValueError(
                f"WeightedMean.{name} must be a scalar (the sum over this batch), got shape "
                f"{jnp.shape(x)} dtype {jnp.result_type(x) if hasattr(x, 'dtype') else type(x).__name__}"
            )
    if not jnp.issubdtype(jnp.result_type(loss.total), jnp.floating):
        raise ValueError(f"WeightedMean.total must be floating point, got {jnp.result_type(loss.total)}")


def device_objective(loss, axes, n_dev: int):
    """This device's share of the objective: ``loss`` itself for a plain scalar (the step
    averages them), ``total * n_dev / W`` for a :class:`WeightedMean` (``W``: the weight summed
    over ``axes``, held constant), whose mean over the devices is the global weighted mean."""
    if not isinstance(loss, WeightedMean):
        return loss
    check_weighted(loss)
    global_weight = lax.psum(lax.stop_gradient(loss.weight), axes)
    return _ratio(loss.total * n_dev, global_weight)


def global_loss(loss, axes):
    """The eval step's loss over the devices: the mean of the means, or the weighted mean."""
    if not isinstance(loss, WeightedMean):
        return lax.pmean(loss, axes)
    check_weighted(loss)
    return _ratio(lax.psum(loss.total, axes), lax.psum(loss.weight, axes))


def warn_if_masked(loss, batch) -> None:
    """Warn (:class:`LocalMeanWarning`) when a plain scalar loss comes with a mask-like batch
    leaf (at trace time: once per compile)."""
    if isinstance(loss, WeightedMean):
        return
    hits = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(batch)[0] if _mask_like(p, x)]
    if hits:
        warnings.warn(
            f"the batch holds {', '.join(hits[:3])} and the loss is a plain scalar: the step trains "
            "the mean of the devices' own means, which is not the one-device objective if the loss "
            "divides by a count of its batch (real tokens, a mask's sum). Return "
            "qsdp_jax.WeightedMean(total=jnp.sum(loss * mask), weight=jnp.sum(mask)) to train the "
            "global weighted mean, or filter qsdp_jax.LocalMeanWarning if the mean is right",
            LocalMeanWarning,
            stacklevel=2,
        )


def _mask_like(path, x) -> bool:
    names = [str(getattr(k, "key", getattr(k, "name", ""))).lower() for k in path]
    named = any("mask" in n or "weights" in n for n in names)
    return named or jnp.result_type(x) == jnp.bool_
