"""One parameter group's layout: its leaves (the per-leaf rule of :mod:`qsdp_jax.layout`) and the
gather buffers its sharded leaves are packed into.

:func:`build_group` applies the rule to one group of the params (:func:`shard_dim` picks the
split dimension) and makes its :class:`LeafLayout` per leaf and its buffers
(:class:`qsdp_jax._src.layout.policy.Buffer`, one per distinct bits); ``ParamLayout.create`` calls it
for every group. Both classes are re-exported by :mod:`qsdp_jax.layout`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qsdp_jax._src.layout import policy
from qsdp_jax._src.layout.policy import Buffer, Slot


def shard_dim(shape: Sequence[int], num_shards: int) -> int | None:
    """The dimension of ``shape`` a leaf is split on over ``num_shards`` devices: the first that
    divides (see :mod:`qsdp_jax.layout`), or None when none does."""
    for d, size in enumerate(shape):
        if size % num_shards == 0 and size > 0:
            return d
    return None


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter leaf is held: its per-layer shape, and the dimension it is split on.

    ``dim`` indexes the per-layer ``shape`` (add 1 for the global array of a stacked leaf);
    None: replicated. ``local_size``: elements of one device's block (per layer); ``buckets``:
    buckets per device (per layer), the block padded to whole buckets.
    """

    index: int  # position among the group's leaves (treedef order)
    path: str  # qsdp_jax._src.layout.policy path, e.g. "blocks/attn/q"
    shape: tuple[int, ...]  # per layer
    dtype: str
    dim: int | None
    local_size: int
    buckets: int

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    def local_shape(self, num_shards: int) -> tuple[int, ...]:
        """The per-layer shape of one device's block."""
        if self.dim is None:
            return self.shape
        s = list(self.shape)
        s[self.dim] //= num_shards
        return tuple(s)


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One parameter group: its leaves, and the flat buffer(s) its sharded leaves are packed
    into for the collectives (one at the config's bits, keyed by the group's name, and one per
    other bits of a ``QSDPConfig.bit_policy``)."""

    name: str
    stacked: bool
    n_layers: int  # 0 for a non-stacked group
    treedef: Any
    leaves: tuple[LeafLayout, ...]
    buffers: tuple[Buffer, ...]

    @property
    def num_leaves(self) -> int:
        return len(self.leaves)

    @property
    def replicated(self) -> tuple[int, ...]:
        return tuple(x.index for x in self.leaves if not x.sharded)

    @property
    def is_sharded(self) -> bool:
        return bool(self.buffers)

    @property
    def real_size(self) -> int:
        """Sharded elements of the group (per layer)."""
        return sum(math.prod(self.leaves[s.index].shape) for b in self.buffers for s in b.slots)

    @property
    def held_size(self) -> int:
        """Padded elements of all the group's gather buffers (per layer, all devices)."""
        return sum(b.flat_size for b in self.buffers)

    flat_size = held_size  # the gathered length of the group (per layer), as collectives count it

    @property
    def chunk(self) -> int:
        """One device's packed elements of all the group's buffers (per layer)."""
        return sum(b.chunk for b in self.buffers)

    def leaf_paths(self) -> list[str]:
        """The ``qsdp_jax._src.layout.policy`` path of every leaf, in treedef order."""
        return [x.path for x in self.leaves]


def build_group(name, tree, is_stacked, n, bucket, min_shard_size, bit_policy, default_bits, undivided) -> GroupLayout:
    """The layout of one group ``name`` of the params (``tree``, concrete or abstract), by the
    rule of :mod:`qsdp_jax.layout`: each leaf split on the first dimension that divides over ``n``
    shards when it is floating and has ``min_shard_size`` elements (per layer when
    ``is_stacked``), else replicated; the sharded leaves packed into one buffer at the config's
    bits (``default_bits``) and one per other bits ``bit_policy`` gives. A large leaf that
    divides on no dimension is appended to ``undivided`` (the caller warns once for all).

    Raises:
      ValueError: a stacked group whose leaves do not share one leading layer axis.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    paths = policy.tree_paths(name, tree)
    n_layers = _layer_count(name, leaves) if is_stacked else 0
    out: list[LeafLayout] = []
    by_bits: dict[policy.Bits | None, list[LeafLayout]] = {}  # None: the config's bits
    for i, leaf in enumerate(leaves):
        shape = tuple(np.shape(leaf)[1:] if is_stacked else np.shape(leaf))
        size, dtype = math.prod(shape), _dtype(leaf)
        large = jnp.issubdtype(dtype, jnp.floating) and size >= min_shard_size and size > 0
        dim = shard_dim(shape, n) if large else None
        if large and dim is None:
            undivided.append(f"{paths[i]} {shape}")
        local = size // n if dim is not None else size
        out.append(LeafLayout(i, paths[i], shape, str(dtype), dim, local, -(-local // bucket)))
        if dim is not None:
            bits = policy.leaf_bits(bit_policy, paths[i]) if bit_policy else None
            by_bits.setdefault(None if bits == default_bits else bits, []).append(out[-1])
    buffers = []
    others = sorted((b for b in by_bits if b is not None), key=policy.bits_label)
    for bits in ([None] if None in by_bits else []) + others:
        slots, offset = [], 0
        for x in by_bits[bits]:
            slots.append(Slot(x.index, x.local_shape(n), x.dtype, offset, x.local_size))
            offset += x.buckets * bucket
        index = 0 if bits is None else others.index(bits) + 1  # keys the buffer's gradient noise
        buffers.append(
            Buffer(
                policy.buffer_key(name, bits), name, index, bits, tuple(slots), offset * n, offset, is_stacked, n_layers
            )
        )
    return GroupLayout(name, is_stacked, n_layers, treedef, tuple(out), tuple(buffers))


def _layer_count(name: str, leaves) -> int:
    dims: set[int | None] = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    leading = next(iter(dims)) if len(dims) == 1 else None
    if leading is None:
        raise ValueError(
            f"stacked group {name!r} needs the same leading layer axis on every leaf, "
            f"got leading dims {sorted(map(str, dims))}"
        )
    return leading


def _dtype(x) -> np.dtype:
    """The dtype JAX gives an array, a ShapeDtypeStruct or a Python scalar on its devices:
    float32 for a Python float or a NumPy float64 array unless ``jax_enable_x64`` (as optax
    trains them), not NumPy's float64."""
    return np.dtype(jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
