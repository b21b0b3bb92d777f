"""Code-held weights (``QSDPConfig.weight_storage="codes"``): on-grid weights stored as their codes.

In ``"qsdp"`` mode every gridded weight lies exactly on its bucket's grid between steps, and the
optimizer state holds that grid (``QSDPState.scales`` / ``offsets``). So a device's block of a
gridded leaf *is* its b-bit codes: ``TrainState.params`` then holds, in place of the leaf, a
uint8 array ``(rows, num_shards * packed_size(buckets * bucket, bits))`` laid out and sharded
like the leaf's grid (``P(None, axes)``): device ``i``'s part is the packed codes of its block,
flattened row-major and padded to whole buckets. ``rows`` is the layer count of a stacked leaf,
else 1. Leaves without a grid (replicated, or full precision by a bit policy) stay as they are.

**Invariant:** ``decode(encode(w)) == w`` bit for bit for weights ``w`` on the grid: the codes are
the float32-held weights. The step therefore trains the same losses and weights as
``weight_storage="float32"``:

* the weight all-gather sends the stored codes and the grid as they are (no quantize pass);
* the gradient reaches the codes' leaves through a zero *anchor* of the block's shape, the
  differentiated argument (:func:`anchors`), which the forward pass never reads;
* the optimizer, in the global view, sees :func:`decode`'d float32 weights and the new ones,
  projected onto the new grid, are :func:`encode`'d (the codes of the snapped weights).

Checkpoints store the codes (a quarter of the weight bytes at 8 bits); where a leaf's buckets are
the same on both meshes (see ``qsdp_jax.checkpoint``) they reshard as they are.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from qsdp_jax import kernels as qk
from qsdp_jax import optim as qoptim
from qsdp_jax._src.quant import grid as qgrid
from qsdp_jax._src.quant import quantizers as qz
from qsdp_jax._src.quant.payload import pack_codes
from qsdp_jax.layout import ParamLayout, leaf_spec

PyTree = Any


def holds_codes(config) -> bool:
    """Whether a config's train state holds its gridded weights as codes."""
    return config.weight_mode == "qsdp" and config.weight_storage == "codes"


def coded(layout: ParamLayout, config) -> list[int | None]:
    """Per leaf (``layout.leaves()`` order): its code bits when it is held as codes, else None."""
    if not holds_codes(config):
        return [None] * sum(g.num_leaves for g in layout.groups)
    return list(layout.weight_bits(config))


def code_width(buckets: int, bucket: int, bits: int) -> int:
    """Bytes of one device's codes of a leaf, per row."""
    return qz.packed_size(buckets * bucket, bits)


def storage_specs(layout: ParamLayout, config) -> dict[str, PyTree]:
    """The PartitionSpec of every leaf of ``TrainState.params``: the grid's ``P(None, axes)`` for
    a code-held leaf, the leaf's own spec otherwise."""
    axes = config.shard_axes
    bits = coded(layout, config)
    return layout.unflatten(
        [leaf_spec(g, x, axes) if b is None else P(None, axes) for (g, x), b in zip(layout.leaves(), bits)]
    )


def values_like(layout: ParamLayout) -> dict[str, PyTree]:
    """The params as ``jax.ShapeDtypeStruct`` of their global shapes and dtypes (what
    :func:`decode` gives), from the layout alone."""
    out = []
    for g, x in layout.leaves():
        shape = ((g.n_layers,) if g.stacked else ()) + tuple(x.shape)
        out.append(jax.ShapeDtypeStruct(shape, jnp.dtype(x.dtype)))
    return layout.unflatten(out)


def stored_like(layout: ParamLayout, config) -> dict[str, PyTree]:
    """``TrainState.params`` as ``jax.ShapeDtypeStruct`` (no shardings): codes' shapes where held."""
    out = jax.tree_util.tree_leaves(values_like(layout))
    for i, ((g, x), b) in enumerate(zip(layout.leaves(), coded(layout, config))):
        if b is not None:
            rows = max(g.n_layers, 1) if g.stacked else 1
            out[i] = jax.ShapeDtypeStruct(
                (rows, layout.num_shards * code_width(x.buckets, layout.bucket, b)), jnp.uint8
            )
    return layout.unflatten(out)


def _block_shape(layout: ParamLayout, i: int) -> tuple[int, ...]:
    g, x = layout.leaves()[i]
    return ((g.n_layers,) if g.stacked else ()) + x.local_shape(layout.num_shards)


def _grids(opt_state) -> tuple[list, list]:
    st = qoptim.find_qsdp_state(opt_state)
    if st is None:
        raise ValueError("code-held weights need the optimizer wrapped with qsdp_jax.optim.qsdp(base, config)")
    return jax.tree_util.tree_leaves(st.scales), jax.tree_util.tree_leaves(st.offsets)


def _per_coded_leaf(tree: dict, opt_state, config, layout: ParamLayout, block, kinds: str) -> dict:
    """``tree`` with ``block(x, scales, offsets, geo, i)`` applied, on each device, to its block
    ``x`` of every code-held leaf ``i`` (with the leaf's grid); ``kinds`` (``"lgg"`` or
    ``"ggg"``, then the result's) as :func:`qsdp_jax._src.quant.grid.per_device` takes them."""
    leaves = jax.tree_util.tree_leaves(tree)
    idx = [i for i, b in enumerate(coded(layout, config)) if b is not None]
    if not idx:
        return tree
    scales, offsets = _grids(opt_state)
    geos = qgrid.geometries(tree, config)

    def fn(shard, xs, ss, os_):
        del shard
        return ([block(x, s, o, geos[i], i) for x, s, o, i in zip(xs, ss, os_, idx)],)

    picked = [[v[i] for i in idx] for v in (leaves, scales, offsets)]
    (blocks,) = qgrid.per_device(fn, [geos[i] for i in idx], kinds[:3], kinds[3:], *picked)
    out = list(leaves)
    for j, i in enumerate(idx):
        out[i] = blocks[j]
    return layout.unflatten(out)


def encode(params: dict, opt_state, config, layout: ParamLayout) -> dict:
    """``params`` with each gridded leaf replaced by its codes on the grid of ``opt_state``
    (round to nearest, clipped): a leaf on that grid gets its exact codes, and a leaf projected
    onto it but not snapped yet (``optax.apply_updates`` of a ``qsdp`` update) the codes of the
    snapped leaf, so the train step encodes without a snap.

    Traced inside the train step's layout context (``qsdp_jax._src.quant.grid.layout_context``)."""
    bucket = config.bucket_size

    def block(x, s, o, geo, i):
        b = geo.bits
        return qk.select(
            config.kernels,
            lambda r, s, o: pack_codes(qz.quantize_on_grid(r, s, o, b, bucket)),
            lambda r, s, o, target: qk.grid_pack(r, s, o, b, bucket, target=target),
            qgrid.rows_of(x, geo, bucket),
            s,
            o,
            bucket=bucket,
        )

    return _per_coded_leaf(params, opt_state, config, layout, block, "lggg")


def decode(stored: dict, opt_state, config, layout: ParamLayout) -> dict:
    """The float32-held weights of ``TrainState.params`` (the inverse of :func:`encode`), global
    arrays sharded like the leaves; in the train step's layout context."""
    bucket = config.bucket_size

    def block(c, s, o, geo, i):
        # the elementwise decode, which XLA fuses into the optimizer's update: behind
        # payload.cpu_boundary (dequantize_parts) it is written out, and the GPT-1.3B W8G8
        # step's peak rose from 3934 to 4591 MB
        b, n = geo.bits, geo.buckets * bucket
        values = qk.select(
            config.kernels,
            lambda c, s, o: qz.dequantize(qz.unpack_bits(c, b, n), s, o, bucket),
            lambda c, s, o, target: qk.unpack_dequantize(c, s, o, b, bucket, n, target=target),
            c,
            s,
            o,
            bucket=bucket,
        )
        dtype = jnp.dtype(layout.leaves()[i][1].dtype)
        return values[:, : geo.size].reshape(_block_shape(layout, i)).astype(dtype)

    return _per_coded_leaf(stored, opt_state, config, layout, block, "gggl")


def anchors(stored_blocks: dict, layout: ParamLayout, config) -> tuple[dict, list | None]:
    """Inside the step's ``shard_map``: ``(differentiated blocks, codes)`` of this device's
    ``TrainState.params`` blocks. A code-held leaf's differentiated block is a zero of the leaf
    block's shape and dtype (its gradient is the reduce-scattered one; the forward pass reads the
    codes, never it), the others' their own blocks; ``codes`` lists, in leaf order, each
    code-held leaf's codes block and None for the others (None when no leaf is code-held)."""
    leaves = jax.tree_util.tree_leaves(stored_blocks)
    bits = coded(layout, config)
    diff: list = []
    codes: list = []
    for i, (x, b) in enumerate(zip(leaves, bits)):
        if b is None:
            diff.append(x)
            codes.append(None)
        else:
            diff.append(jnp.zeros(_block_shape(layout, i), jnp.dtype(layout.leaves()[i][1].dtype)))
            codes.append(x)
    return layout.unflatten(diff), (codes if any(c is not None for c in codes) else None)


def check_stored(params: dict, layout: ParamLayout, config) -> None:
    """A clear error when a train state's ``params`` are not held as ``config`` says (a state
    made with another ``weight_storage``)."""
    want = jax.tree_util.tree_leaves(stored_like(layout, config))
    have = jax.tree_util.tree_leaves(params)
    for (g, x), a, b in zip(layout.leaves(), have, want):
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            held = "codes" if a.dtype == jnp.uint8 else "float32"
            raise ValueError(
                f"the state holds {x.path} as {a.dtype}{list(a.shape)} but the config's "
                f"weight_storage={config.weight_storage!r} holds it as {b.dtype}{list(b.shape)} "
                f"(the state looks made with weight_storage={held!r}): make the state with "
                "init_train_state and the step's config"
            )


def state_config(opt_state):
    """The config the state's ``qsdp`` optimizer was built with, or None."""
    st = qoptim.find_qsdp_state(opt_state)
    return None if st is None else st.config


def decoded_params(state) -> dict:
    """A TrainState's weights as global float32-held arrays: ``state.params`` decoded when it
    holds codes (the config comes from its optimizer state), else as it is."""
    config = state_config(state.opt_state)
    if config is None or not holds_codes(config):
        return state.params
    mesh = jax.tree_util.tree_leaves(state.params)[0].sharding.mesh
    return _decoder(state.layout, config, mesh)(state.params, state.opt_state)


@functools.lru_cache(maxsize=32)
def _decoder(layout: ParamLayout, config, mesh):
    """The jitted :func:`decode` of one layout, config and mesh (compiled once, not per call)."""

    def fn(stored, opt_state):
        with qgrid.layout_context(layout, mesh, config.shard_axes):
            return decode(stored, opt_state, config, layout)

    return jax.jit(fn, out_shardings=layout.shardings(mesh, config.shard_axes))
