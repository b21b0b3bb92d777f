""":class:`ShardedParams`: the :class:`~qsdp_jax.access.ParamAccess` inside the train step.

Inside the step's ``shard_map`` each device holds its block of every sharded leaf (and the
whole of every replicated one). ``gather(group)`` packs the group's blocks into its flat
buffer(s) (:func:`qsdp_jax._src.layout.packing.pack`), all-gathers them (quantized per the config; lossless
in ``"qsdp"`` mode, where the blocks lie on the grid held by the optimizer), and unpacks the full
leaves; the backward pass of the gather reduce-scatters the buffer's gradient (quantized), so
each device receives the summed gradient of its own blocks. ``call(group, fn, *args)`` gathers for
one call of ``fn`` and again in its backward pass (:mod:`qsdp_jax._src.collective.regather`).
``scan(group, ...)`` does the same one layer at a time inside a rematerialised ``lax.scan`` body,
so peak memory holds one layer; its backward pass is :func:`qsdp_jax._src.step.layer_scan.remat_scan`'s,
whose gradient buffers exist only from when the backward pass starts.

Code-held weights (:mod:`qsdp_jax._src.quant.weight_codes`): the payload of a code-held buffer is built
from the stored codes and grid and gathered as it is (:func:`qsdp_jax.collectives.make_coded_gather`);
the blocks given as ``params`` are then zero anchors that carry the gradient.

Gradient-quantization keys are ``derive_key(seed, GRAD, step, group, layer[, buffer])`` folded
with the sender's index: the backward re-gather and every resumed run see the same randomness.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qsdp_jax._src.layout import packing
from qsdp_jax._src.quant import quantizers as qz
from qsdp_jax._src.step.layer_scan import remat_scan
from qsdp_jax._src.step.prefetch_scan import prefetch_scan
from qsdp_jax._src.quant.payload import dequantize_parts
from qsdp_jax._src.collective.regather import regathered, tie, tied
from qsdp_jax._src.collective.sharded_take import Split, take_rows
from qsdp_jax.access import check_take
from qsdp_jax.collectives import GatherSpec, make_coded_gather, make_gather, make_gather_pieces, payload_from_packed
from qsdp_jax.config import QSDPConfig
from qsdp_jax._src.collective.hierarchy import gather_spec
from qsdp_jax._src.layout.policy import Buffer
from qsdp_jax.layout import GroupLayout, ParamLayout

PyTree = Any
PURPOSE_GRAD = 2


class ShardedParams:
    """:class:`qsdp_jax.access.ParamAccess` over one device's blocks (see the module docstring).

    Args:
      layout: the train state's layout.
      params: this device's blocks, the params' structure.
      grid: ``(scales, offsets)`` trees of this device's grid blocks (``"qsdp"`` mode), or None.
      step: the step being taken (keys the gradient noise).
      config: the run's config.
      codes: code-held weights (``qsdp_jax._src.quant.weight_codes``): per leaf in layout order,
        this device's codes block, or None for a leaf ``params`` holds; ``params`` then holds
        zero anchors in the code-held leaves' places. None (the default): no code-held leaf.
      prefetch_layers: an ``overlap.Prefetch``: the layer loops (``scan``, ``chain``) gather the
        next layer while this one computes (:mod:`qsdp_jax._src.step.prefetch_scan`), for
        compilers that do not pipeline the gathers themselves; None (the default): they do not.
    """

    def __init__(
        self, layout: ParamLayout, params: dict, grid, step, config: QSDPConfig, codes=None, prefetch_layers=None
    ):
        self._layout = layout
        self._params = params
        self._grid = grid
        self._step = step
        self._config = config
        self._codes = codes
        self._prefetch_layers = prefetch_layers
        self._codes_of: dict[str, list | None] = {}
        first = 0
        for g in layout.groups:
            self._codes_of[g.name] = None if codes is None else list(codes[first : first + g.num_leaves])
            first += g.num_leaves
        self._prefetch: jax.Array | None = None  # regather.tie of the last call's inputs

    def _key(self, group: str, layer, buffer: Buffer, gi=None) -> jax.Array:
        gi = self._layout.group_index(group) if gi is None else gi  # traced in chain()
        if buffer.index == 0:
            return qz.derive_key(self._config.seed, PURPOSE_GRAD, self._step, gi, layer)
        return qz.derive_key(self._config.seed, PURPOSE_GRAD, self._step, gi, layer, buffer.index)

    def _spec(self, buffer: Buffer):
        config = self._config if buffer.bits is None else self._config.buffer_config(*buffer.bits)
        spec = gather_spec(config)
        if self._prefetch_layers and self._prefetch_layers.scatter_by_all_to_all and isinstance(spec, GatherSpec):
            return dataclasses.replace(spec, fp_by_all_to_all=True)
        return spec

    def _gather_buffer(self, buffer: Buffer, flat, grid, key) -> tuple:
        """One buffer's gather (its gradient's reduce-scatter in the backward), at its bits:
        every device's block of each of its leaves (``packing.unpack``'s pieces)."""
        spec = self._spec(buffer)
        if self._prefetch_layers and spec.weight_mode == "full":
            # one float gather a buffer, not one a leaf: XLA:TPU ran only some of a layer's
            # per-leaf gathers asynchronously (GPT-125M fp32 on v5p: 1 of 5 in the backward loop)
            full = make_gather(spec)(flat, grid, key).reshape(-1, buffer.chunk)  # float32
            return packing.split_flat(full, packing.spans(buffer))
        return make_gather_pieces(spec, packing.spans(buffer), buffer.chunk)(flat, grid, key)

    def _gather_coded(self, buffer: Buffer, anchor, payload, key) -> tuple:
        """A code-held buffer's gather of its stored codes (its gradient's reduce-scatter into
        ``anchor``'s gradient in the backward), as :meth:`_gather_buffer`."""
        return make_coded_gather(self._spec(buffer), packing.spans(buffer), buffer.chunk)(anchor, payload, key)

    def _has_grid(self, buffer: Buffer) -> bool:
        return self._grid is not None and buffer.resolved_bits(self._config)[0] is not None

    def _buffer_grid(self, buffer: Buffer, grids):
        """The buffer's (scales, offsets): its leaves' grid blocks concatenated, per layer rows."""
        if grids is None:
            return None
        scales, offsets = grids
        return (
            jnp.concatenate([scales[s.index] for s in buffer.slots], axis=-1),
            jnp.concatenate([offsets[s.index] for s in buffer.slots], axis=-1),
        )

    def _full_leaves(self, g: GroupLayout, blocks: list, grids, layer, codes=None, gi=None) -> PyTree:
        """The group's full leaves (one layer's, inside ``scan``) from this device's blocks (and
        codes blocks, for code-held leaves); ``gi``: the group index its keys take (traced, in
        :meth:`chain`), else ``g``'s."""
        out = list(blocks)
        n = self._layout.num_shards
        for b in g.buffers:
            flat = packing.pack(b, blocks, self._layout.bucket)
            grid = self._buffer_grid(b, grids) if self._has_grid(b) else None
            key = self._key(g.name, layer, b, gi)
            if codes is not None and codes[b.slots[0].index] is not None:
                assert grid is not None  # code-held leaves are gridded
                packed = jnp.concatenate([codes[s.index].reshape(-1) for s in b.slots])
                payload = payload_from_packed(packed, *grid)
                pieces = self._gather_coded(b, flat, payload, key)
            else:
                pieces = self._gather_buffer(b, flat, grid, key)
            leaves = [g.leaves[s.index] for s in b.slots]
            got = packing.unpack(b, pieces, n, [x.dim for x in leaves], [x.shape for x in leaves])
            for i, x in got.items():
                out[i] = x
        return jax.tree_util.tree_unflatten(g.treedef, out)

    def _group_grids(self, g: GroupLayout):
        if self._grid is None:
            return None
        scales, offsets = self._grid
        # leaves without a grid hold an empty placeholder: None, so that scan() skips them
        side = lambda tree: [x if x.size else None for x in jax.tree_util.tree_leaves(tree)]  # noqa: E731
        return side(scales[g.name]), side(offsets[g.name])

    def gather(self, group: str) -> PyTree:
        # after a call, the gather waits for that call's inputs (regather.tied): XLA would
        # otherwise hoist it to the start of the step, and a group read at the end (a tied
        # embedding's attend at the head) would be held whole across every call before it
        return self.gather_blocks(group, tied(self.blocks(group), self._prefetch))

    def fresh(self) -> "ShardedParams":
        """The same access without the last call's prefetch tie: for another trace of the
        loss (a tie holds a value of the trace that made it)."""
        return ShardedParams(
            self._layout, self._params, self._grid, self._step, self._config, self._codes, self._prefetch_layers
        )

    def call(self, group: str, fn, *args):
        """``fn(gather(group), *args)`` with the group gathered again in the backward pass
        (:func:`qsdp_jax._src.collective.regather.regathered`); ``args`` are pytrees of arrays."""
        self._unstacked(group, "call")
        gather = lambda blocks: self.gather_blocks(group, blocks)  # noqa: E731
        out = regathered(gather, fn, self.blocks(group), args, self._prefetch)
        self._prefetch = tie(args)  # the next call's gather waits for these inputs
        return out

    def chain(self, groups: list, body, init) -> list:
        """``body(gather(groups[i]), carry, i) -> carry`` for each group in turn, all through one
        rematerialised scan body (:func:`~qsdp_jax._src.step.layer_scan.remat_scan`, the blocks kept
        apart), with the gathers, keys and gradients :meth:`call` gives each group. The groups'
        layouts are alike (:func:`layout_signature`). Returns each group's output, in order."""
        gs = [self._unstacked(name, "call") for name in groups]
        blocks = [tied(self.blocks(name), self._prefetch) for name in groups]
        grids = None
        if self._grid is not None:
            per = [self._group_grids(g) for g in gs]
            grids = tuple(
                [None if x is None else jnp.stack([p[side][j].reshape(-1) for p in per]) for j, x in enumerate(first)]
                for side, first in enumerate(per[0])
            )
        codes = [c for c in (self._codes_of[name] for name in groups) if c is not None]
        stacked_codes = None  # code-held leaves are so in every group of a chain (alike layouts)
        if codes:
            stacked_codes = [None if c is None else jnp.stack([cs[j] for cs in codes]) for j, c in enumerate(codes[0])]
        index = jnp.asarray([self._layout.group_index(name) for name in groups], jnp.int32)

        def gather(blocks_l, const):
            grids_l, codes_l, gi, _ = const
            return self._full_leaves(gs[0], blocks_l, grids_l, 0, codes_l, gi)

        def call(carry, weights, _, const):
            out = body(weights, carry, const[3])
            return out, out

        consts = (grids, stacked_codes, index, jnp.arange(len(groups), dtype=jnp.int32))
        if self._prefetch_layers:
            _, ys = prefetch_scan(gather, call, init, blocks, None, consts, apart=True)
        else:
            layer = lambda carry, blocks_l, const: call(carry, gather(blocks_l, const), None, const)  # noqa: E731
            _, ys = remat_scan(layer, init, blocks, consts, apart=True)
        outs = [ys[i] for i in range(len(groups))]
        self._prefetch = tie(outs[-2])  # the last call's inputs, as call() ties them
        return outs

    def signature(self, group: str) -> tuple:
        """:func:`layout_signature` of ``group``."""
        return layout_signature(self._layout.group(group))

    def blocks(self, group: str) -> list:
        """This device's blocks of ``group``'s leaves, in leaf order."""
        return jax.tree_util.tree_leaves(self._params[group])

    def _unstacked(self, group: str, how: str) -> GroupLayout:
        g = self._layout.group(group)
        if g.stacked:
            raise ValueError(f"group {group!r} is layer-stacked: read it with scan(), not {how}()")
        return g

    def gather_blocks(self, group: str, blocks: list) -> PyTree:
        """``gather(group)`` of the given blocks (as :meth:`blocks` lists them): a gather
        inside a function of the blocks, e.g. one the backward pass calls again."""
        g = self._unstacked(group, "gather")
        grids = self._group_grids(g)
        if grids is not None:  # a non-stacked leaf's grid is one row
            grids = tuple([None if x is None else x.reshape(-1) for x in side] for side in grids)
        return self._full_leaves(g, list(blocks), grids, 0, self._codes_of[group])

    def take(self, path: str, ids: jax.Array) -> jax.Array:
        """``jnp.take(leaf, ids, axis=0)`` of the leaf at ``path``, read from this device's
        block of it (:func:`qsdp_jax._src.collective.sharded_take.take_rows`); a replicated leaf is read
        whole."""
        group = path.split("/")[0]
        g = self._unstacked(group, "take")
        by_path = {x.path: x for x in g.leaves}
        if path not in by_path:
            raise KeyError(f"no leaf {path!r} in group {group!r}; its leaves are {list(by_path)}")
        x = by_path[path]
        block = self.blocks(group)[x.index]
        check_take(path, len(x.shape), ids)
        if x.dim is None:
            return jnp.take(block, ids, axis=0)
        config = self._config
        split = Split(block.shape, str(block.dtype), x.dim, x.shape[0], config.shard_axes, config.replica_axis)
        return take_rows(block, self._block_values(g, x, block), ids, split)

    def _block_values(self, g: GroupLayout, x, block: jax.Array) -> jax.Array:
        """This device's weights of leaf ``x``: ``block``, or its codes decoded behind
        ``cpu_boundary`` (``dequantize_parts``, as the gather's receive). The optimizer's fused
        decode (``weight_codes.decode``) made GPT-1.3B's code-held W4G4 ``+take`` peak worse:
        3041.6 -> 3119.7 MB."""
        codes = self._codes_of[g.name]
        if codes is None or codes[x.index] is None:
            return block
        buffer = next(b for b in g.buffers if any(s.index == x.index for s in b.slots))
        scales, offsets = self._group_grids(g)
        n = x.buckets * self._layout.bucket
        bits = buffer.resolved_bits(self._config)[0]
        packed, bucket = codes[x.index].reshape(-1), self._layout.bucket
        values = dequantize_parts(packed, scales[x.index].reshape(-1), offsets[x.index].reshape(-1), n, bits, bucket)
        return values.reshape(-1)[: block.size].reshape(block.shape)

    def scan(self, group, body, init, xs=None, *, remat=True):
        g = self._layout.group(group)
        if not g.stacked:
            raise ValueError(f"group {group!r} is not layer-stacked: read it with gather(), not scan()")
        blocks = jax.tree_util.tree_leaves(self._params[group])
        grids = self._group_grids(g)
        codes = self._codes_of[group]

        def gather(blocks_l, const):
            grids_l, codes_l, index = const
            return self._full_leaves(g, blocks_l, grids_l, index, codes_l)

        def layer(carry, diff, const):
            (blocks_l, x) = diff
            return body(carry, gather(blocks_l, const), x)

        indices = jnp.arange(g.n_layers, dtype=jnp.int32)
        if remat and self._prefetch_layers:  # the next layer's gather under this one's matmuls
            consts = (grids, codes, indices)
            return prefetch_scan(gather, lambda c, w, x, _: body(c, w, x), init, blocks, xs, consts)
        if remat:  # the backward's gradient buffers exist from when it starts (layer_scan)
            return remat_scan(layer, init, (blocks, xs), (grids, codes, indices))
        return lax.scan(lambda c, x: layer(c, *x), init, ((blocks, xs), (grids, codes, indices)))


def layout_signature(g: GroupLayout) -> tuple:
    """What :meth:`ShardedParams.chain` needs alike in its groups: the leaves' shapes, dtypes and
    split, and the buffers' bits and packing (names and paths aside)."""
    leaves = tuple((x.index, x.shape, x.dtype, x.dim, x.local_size, x.buckets) for x in g.leaves)
    buffers = tuple((b.index, b.bits, b.slots, b.flat_size, b.chunk) for b in g.buffers)
    return (g.stacked, g.treedef, leaves, buffers)
