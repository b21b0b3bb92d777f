"""The differentiable gathers: a ``custom_vjp`` pairing a spec's gather (forward) with its
reduce-scatter of the cotangent (backward), one per (hashable) spec; re-exported by
:mod:`qsdp_jax.collectives`, whose ``GatherSpec`` (or the two-level ``TwoLevelSpec``) they take.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qsdp_jax._src.layout.packing import join_pieces


@functools.lru_cache(maxsize=None)
def make_gather(spec):
    """The differentiable gather of ``spec``: a ``custom_vjp`` pairing the two collectives.

    Cached: one function per (hashable) spec.

    Args:
      spec: the :class:`GatherSpec`.

    Returns:
      The function ``gather(shard, grid, key) -> full``. Forward ``spec.gather(shard, grid)``;
      backward reduce-scatters the cotangent (as float32) with ``spec.reduce_scatter`` under
      ``key`` (summed over devices, not averaged). ``grid`` and ``key`` get no gradient.
    """

    @jax.custom_vjp
    def gather(shard, grid, key):
        return spec.gather(shard, grid)

    def fwd(shard, grid, key):
        return spec.gather(shard, grid), key

    def bwd(key, ct):
        return spec.reduce_scatter(ct.astype(jnp.float32), key), None, None

    gather.defvjp(fwd, bwd)
    return gather


@functools.lru_cache(maxsize=None)
def make_gather_pieces(spec, spans: tuple, chunk: int):
    """:func:`make_gather` whose forward returns the gathered buffer cut into pieces, decoded
    straight into them (``spec.gather_pieces``): the step's gather, which never holds a layer's
    full float buffer next to its leaves.

    Args:
      spec: the gather spec (``GatherSpec`` or ``TwoLevelSpec``).
      spans: ``(offset, size)`` of each piece in one device's ``chunk`` (offsets whole buckets).
      chunk: one device's shard length.

    Returns:
      ``gather(shard, grid, key) -> pieces``, each ``(senders, size)`` float32; the backward
      joins the pieces' cotangents (zeros in the gaps) and reduce-scatters them under ``key``.
    """

    return _paired(lambda shard, grid: spec.gather_pieces(shard, grid, spans), spec, spans, chunk)


@functools.lru_cache(maxsize=None)
def make_coded_gather(spec, spans: tuple, chunk: int):
    """:func:`make_gather_pieces` for code-held weights: ``gather(anchor, payload, key) ->
    pieces``.

    Forward ``spec.payload_pieces(payload, chunk, spans)``: the payload (the stored codes and the
    grid) travels as it is; ``anchor`` is a zero shard that the forward never reads, the
    differentiated input: the backward reduce-scatters the cotangent into its gradient as
    :func:`make_gather_pieces` does. ``payload`` and ``key`` get no gradient.
    """

    return _paired(lambda anchor, payload: spec.payload_pieces(payload, chunk, spans), spec, spans, chunk)


def _paired(forward, spec, spans, chunk):
    """``gather(x, y, key) = forward(x, y)``, a ``custom_vjp`` whose backward joins the pieces'
    cotangents and reduce-scatters them under ``key`` into ``x``'s gradient (``y`` and ``key``
    get none)."""

    @jax.custom_vjp
    def gather(x, y, key):
        return forward(x, y)

    def fwd(x, y, key):
        return forward(x, y), key

    def bwd(key, cts):
        full = join_pieces([ct.astype(jnp.float32) for ct in cts], spans, chunk)  # (senders, chunk)
        return spec.reduce_scatter(full.reshape(-1), key), None, None

    gather.defvjp(fwd, bwd)
    return gather
