"""A sticky weight grid: stochastic rounding onto the grid a bucket already has, while it fits.

In ``"qsdp"`` mode the optimizer moves each weight ``w`` (on its bucket's grid) by an update
``u`` and rounds ``w + u`` back onto a grid. With a fresh min/max grid every step
(``QSDPConfig.weight_grid="fresh"``), a bucket's range moves with its extreme weights, so every
other weight of the bucket lands off the new grid and is re-rounded, update or not: each step
adds rounding noise of the order of a grid step times the shift of the grid, on top of the
noise of the update itself. With ``weight_grid="sticky"`` a bucket keeps its grid (scale and
offset) while the new values still lie on it and fill at least :data:`MIN_FILL` of its range;
then a weight that did not move stays exactly where it is, and one that moved by ``u`` moves to
a neighbouring grid point with probability ``|u| / scale``. A bucket whose values leave the
grid (or shrink to less than :data:`MIN_FILL` of it) gets a new grid over its range widened by
:data:`HEADROOM` of the range on each side, so that its extreme weights can move about a
sixteenth of the range before the next refit: without headroom the extremes sit on the grid's
edges, one of them moves outward in most steps and the grid is refitted nearly every step.

Invariant (both cases): the result is ``offset + code * scale`` with every code in
``[0, 2**bits - 1]``, and its expectation over the rounding is the input, up to a clip of at
most ``2**-16`` of a step at the edges of a kept grid (float rounding of a value that was on
the edge). The gather stays lossless: the weights are on the grid the optimizer state holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qsdp_jax import quantizers as qz

__all__ = ["HEADROOM", "MIN_FILL", "quantize_sticky", "kept_buckets"]

HEADROOM = 1.0 / 16
"""A refitted grid spans the bucket's range plus this fraction of it on each side (so its steps
are 1.125x those of a min/max grid)."""

MIN_FILL = 0.5
"""A kept grid is refitted once its bucket's values span less than this fraction of it."""

_EDGE = 2.0**-16  # relative slack at the grid's edges, in steps: float rounding of w = off + q*s


def kept_buckets(lo: jax.Array, hi: jax.Array, scales: jax.Array, offsets: jax.Array, bits: int) -> jax.Array:
    """True per bucket where values in ``[lo, hi]`` stay on the grid ``(scales, offsets)``.

    A grid fits when ``[lo, hi]`` lies inside ``[offset, offset + top * scale]`` (up to
    ``2**-16`` of a step, float rounding of values on the edge) and fills at least
    :data:`MIN_FILL` of it; a constant grid (scale 0) fits only the constant it holds. NaN
    never fits."""
    top = qz.levels(bits)
    slack = _EDGE * top
    inv = qz._inverse(scales)
    t_lo, t_hi = (lo - offsets) * inv, (hi - offsets) * inv
    inside = (t_lo >= -slack) & (t_hi <= top + slack) & (t_hi - t_lo >= MIN_FILL * top)
    constant = (scales == 0) & (lo == offsets) & (hi == offsets)
    return jnp.where(scales > 0, inside, constant)


def quantize_sticky(
    x: jax.Array,
    bits: int,
    bucket: int,
    key: jax.Array,
    scales: jax.Array | None,
    offsets: jax.Array | None,
    bucket_ids: jax.Array | None = None,
    stats_dtype: str = "float32",
    headroom: float = HEADROOM,
) -> qz.QTensor:
    """Stochastically round ``x`` (..., n) onto the kept grid ``(scales, offsets)`` (...,
    n // bucket) in buckets it fits (:func:`kept_buckets`), onto a new grid over the bucket's
    range widened by ``headroom`` of it on each side in the others (in all of them when
    ``scales`` and ``offsets`` are None: the first grid).

    The randomness is :func:`quantizers.quantize`'s: the same key and bucket ids draw the same
    uniforms, so with ``headroom=0`` a refitted bucket gets exactly the codes and grid
    ``quantize(..., "stochastic")`` gives it."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom={headroom!r} is invalid: must be a fraction in [0, 1)")
    if key is None:
        raise ValueError("quantize_sticky needs a key (stochastic rounding)")
    xb = qz.to_buckets(x.astype(jnp.float32), bucket)
    if scales is None or offsets is None:  # no grid yet: one that never fits
        scales = offsets = jnp.full(xb.shape[:-1], jnp.nan, jnp.float32)
    if scales.shape != xb.shape[:-1] or offsets.shape != xb.shape[:-1]:
        raise ValueError(
            f"the kept grid has scales {scales.shape} and offsets {offsets.shape}; x of shape "
            f"{x.shape} in buckets of {bucket} needs {xb.shape[:-1]}"
        )
    lo, hi = qz.bucket_range(xb)
    top = qz.levels(bits)
    pad = jnp.float32(headroom) * (hi - lo)
    fresh_scales, fresh_offsets = qz.grid_stats(lo - pad, hi + pad, top, stats_dtype)
    keep = kept_buckets(lo, hi, scales, offsets, bits)
    scales = jnp.where(keep, scales, fresh_scales)
    offsets = jnp.where(keep, offsets, fresh_offsets)
    if bucket_ids is None:
        bucket_ids = qz.default_bucket_ids(x.shape, bucket)
    t = (xb - offsets[..., None]) * qz._inverse(scales)[..., None]
    q = jnp.clip(qz.stochastic_floor(t, key, bucket_ids, bucket), 0, top)
    codes = q.astype(jnp.uint8).reshape(x.shape)
    return qz.QTensor(codes=codes, scales=scales, offsets=offsets, bits=bits, bucket=bucket)
