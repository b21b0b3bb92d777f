"""How each parameter leaf is sharded (per-parameter FSDP, as in PyTorch FSDP2): the layout.

**The rule.** The parameters are the model's own pytree (a dict of *groups*), and every leaf is a
global ``jax.Array``. A leaf is *sharded* over the FSDP axis (axes) when it is floating point,
has at least ``min_shard_size`` elements (per layer, for a layer-stacked group) and some
dimension divides by the shard count: it is split on the **first** such dimension (after the
layer axis of a stacked group). The first, not the largest: then each device's shard is one
contiguous block of the row-major leaf, so when that block is whole buckets the buckets do not
depend on the device count (a checkpoint reshards with its grid unchanged, and the sharded
QSDP step equals the single-device one bit for bit). Any other leaf is *replicated* on every
device in full precision (its gradient averaged); a large leaf that divides on no dimension is
replicated with a warning naming it (pad the model's dimension to fix it). The rule is applied
group by group in :mod:`qsdp_jax._src.layout.group`, home of ``GroupLayout`` and ``LeafLayout``.

**Buckets** live inside one device's shard: device ``i``'s block of a leaf, flattened
row-major and padded to whole buckets, holds buckets ``i * nb .. (i + 1) * nb - 1`` of that leaf
(``nb`` per shard; per layer for a stacked leaf). A leaf's grid (QSDP mode) is therefore a
``(rows, n * nb)`` array sharded on its last axis, ``rows`` the layer count or 1.

**Communication** stays one collective per group (per layer): inside the step each group's local
shards are packed into one flat buffer (each leaf's block padded to whole buckets, then
concatenated: :mod:`qsdp_jax._src.layout.packing`), all-gathered (quantized) and decoded into the full
leaves; the gradient comes back through one reduce-scatter of the same buffer. An unquantized
gather sends each leaf's block in an all-gather of its own (the same bytes; no copy of each leaf
out of a gathered float buffer). A bit policy gives a group one buffer per distinct bits.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from qsdp_jax._src.layout import policy
from qsdp_jax._src.layout.group import GroupLayout, LeafLayout, build_group, shard_dim  # noqa: F401  (re-exported)
from qsdp_jax._src.layout.policy import Buffer

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Static description of a sharded parameter pytree (see the module docstring).

    Built by :meth:`create` (``TrainState.layout`` holds the one of a train state); frozen and
    hashable, so it is a static field of the state.

    Attributes:
      groups: one ``GroupLayout`` per parameter group, sorted by group name: its leaves (shape,
        split dimension, buckets per device) and its gather buffers.
      num_shards: how many pieces each sharded leaf is cut into (the product of the shard axes'
        sizes).
      bucket: elements per bucket (``QSDPConfig.bucket_size``).
    """

    groups: tuple[GroupLayout, ...]
    num_shards: int
    bucket: int

    @classmethod
    def create(
        cls,
        params: dict[str, PyTree],
        num_shards: int,
        bucket: int,
        min_shard_size: int,
        stacked: Sequence[str] = (),
        bit_policy: Sequence[tuple] = (),
        default_bits: tuple | None = None,
    ) -> "ParamLayout":
        """The layout of ``params`` (concrete or abstract arrays), by the rule of the module
        docstring.

        A large floating leaf that divides over ``num_shards`` on no dimension is replicated
        with a warning naming it.

        Args:
          params: a non-empty dict of groups, the leaves arrays or ``jax.ShapeDtypeStruct``.
          num_shards: the number of pieces a sharded leaf is cut into.
          bucket: elements per bucket (``QSDPConfig.bucket_size``).
          min_shard_size: leaves with fewer elements (per layer, in a stacked group) are
            replicated (``QSDPConfig.min_shard_size``).
          stacked: the groups whose leaves carry a leading layer axis.
          bit_policy: ``QSDPConfig.bit_policy``: the sharded leaves a rule gives other bits than
            ``default_bits`` go into buffers of their own.
          default_bits: the config's ``(weight_bits, grad_bits)``.

        Returns:
          The layout.

        Raises:
          ValueError: ``params`` is not a non-empty dict; a ``stacked`` group is not in
            ``params``; a stacked group's leaves do not share one leading layer axis; a
            ``bit_policy`` rule matches no sharded leaf.
        """
        if not isinstance(params, dict) or not params:
            raise ValueError("params must be a non-empty dict of groups, e.g. {'embed': ..., 'blocks': ...}")
        unknown = set(stacked) - set(params)
        if unknown:
            raise ValueError(f"stacked groups {sorted(unknown)} are not in params (groups: {sorted(params)})")
        groups: list[GroupLayout] = []
        sharded_paths: list[str] = []
        replicated_paths: list[str] = []
        undivided: list[str] = []
        for name in sorted(params):
            g = build_group(
                name,
                params[name],
                name in stacked,
                num_shards,
                bucket,
                min_shard_size,
                bit_policy,
                default_bits,
                undivided,
            )
            groups.append(g)
            for x in g.leaves:
                (sharded_paths if x.sharded else replicated_paths).append(x.path)
        if bit_policy:
            policy.check_rules_match(bit_policy, sharded_paths, replicated_paths)
        if undivided:
            warnings.warn(
                f"parameters {undivided} divide over {num_shards} devices on no dimension: they are "
                "replicated on every device, in full precision (make one of their dimensions a "
                f"multiple of {num_shards} to shard them)",
                stacklevel=3,
            )
        return cls(groups=tuple(groups), num_shards=num_shards, bucket=bucket)

    def group(self, name: str) -> GroupLayout:
        """The layout of one parameter group.

        Args:
          name: the group's name (a key of the params dict).

        Returns:
          Its ``GroupLayout``.

        Raises:
          KeyError: no group of that name (the message lists the groups).
        """
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"unknown parameter group {name!r}; groups are {[g.name for g in self.groups]}")

    def group_index(self, name: str) -> int:
        """The position of a group in :attr:`groups` (groups are sorted by name).

        Args:
          name: the group's name.

        Returns:
          Its index.

        Raises:
          KeyError: no group of that name.
        """
        return [g.name for g in self.groups].index(self.group(name).name)

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        """Every gather buffer, group by group."""
        return tuple(b for g in self.groups for b in g.buffers)

    def buffer(self, key: str) -> Buffer:
        """One gather buffer by its key.

        Args:
          key: the buffer's key: the group's name for the buffer at the config's bits,
            ``"group@W8G8"`` for a bit policy's (see ``qsdp_jax._src.layout.policy.buffer_key``).

        Returns:
          The buffer.

        Raises:
          KeyError: no buffer with that key (the message lists the keys).
        """
        for b in self.buffers:
            if b.key == key:
                return b
        raise KeyError(f"unknown gather buffer {key!r}; buffers are {[b.key for b in self.buffers]}")

    def leaf_paths(self) -> dict[str, list[str]]:
        """The path of every leaf, group by group.

        Returns:
          A dict ``{group: [leaf path, ...]}`` (leaves in treedef order), the paths a
          ``QSDPConfig.bit_policy`` matches.
        """
        return {g.name: g.leaf_paths() for g in self.groups}

    def leaves(self) -> list[tuple[GroupLayout, LeafLayout]]:
        """Every leaf with its group.

        Returns:
          ``[(GroupLayout, LeafLayout), ...]`` in ``jax.tree.leaves(params)`` order (groups
          sorted by name).
        """
        return [(g, x) for g in self.groups for x in g.leaves]

    def weight_bits(self, config) -> list:
        """The weight bits of every leaf.

        Args:
          config: the run's ``QSDPConfig`` (its bits apply to the buffers a bit policy does not
            set).

        Returns:
          A list in :meth:`leaves` order of the bits of each leaf's buffer, None for a
          replicated leaf or a full-precision one (a bit policy's, or every sharded leaf when
          ``config.weight_bits`` is None).
        """
        by_leaf = {}
        for g in self.groups:
            for b in g.buffers:
                for s in b.slots:
                    by_leaf[(g.name, s.index)] = b.resolved_bits(config)[0]
        return [by_leaf.get((g.name, x.index)) for g, x in self.leaves()]

    # --- shardings -----------------------------------------------------------------------------
    def unflatten(self, leaves: Sequence[Any]) -> dict[str, PyTree]:
        """The params dict from values in :meth:`leaves` order.

        Args:
          leaves: one value per leaf, in :meth:`leaves` order.

        Returns:
          ``{group: pytree}`` with the params' structure and these values.
        """
        out, i = {}, 0
        for g in self.groups:
            out[g.name] = jax.tree_util.tree_unflatten(g.treedef, list(leaves[i : i + g.num_leaves]))
            i += g.num_leaves
        return out

    def specs(self, axes) -> dict[str, PyTree]:
        """The PartitionSpec of every leaf.

        Args:
          axes: the mesh axis (axes) the leaves are sharded over (``QSDPConfig.shard_axes``).

        Returns:
          The params' structure with a ``PartitionSpec`` per leaf, ``P()`` for a replicated
          leaf, ``axes`` on the split dimension of a sharded one (never on a stacked leaf's
          layer axis).
        """
        return self.unflatten([leaf_spec(g, x, axes) for g, x in self.leaves()])

    def grid_specs(self, axes, config) -> dict[str, PyTree]:
        """The PartitionSpec of every leaf's grid (QSDP mode).

        Args:
          axes: the mesh axis (axes) of the shards (``QSDPConfig.shard_axes``).
          config: the run's ``QSDPConfig`` (which leaves have weight bits).

        Returns:
          The params' structure with a ``PartitionSpec`` per leaf, ``P(None, axes)`` for a
          grid (rows x buckets, split on buckets), ``P()`` for the empty placeholder of a leaf
          without weight bits.
        """
        return self.unflatten([P() if w is None else P(None, axes) for w in self.weight_bits(config)])

    def shardings(self, mesh: Mesh, axes) -> dict[str, PyTree]:
        """The ``NamedSharding`` of every leaf: :meth:`specs` placed on ``mesh``.

        Args:
          mesh: the mesh.
          axes: the mesh axis (axes) the leaves are sharded over (``QSDPConfig.shard_axes``).

        Returns:
          The params' structure with a ``NamedSharding`` per leaf.
        """
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs(axes), is_leaf=lambda x: isinstance(x, P))

    def table(self) -> str:
        """A readable summary of the layout.

        Returns:
          A text table with, per leaf, its path, its global shape, the dimension it is split
          on (or ``replicated``) and its buckets per device; followed by :meth:`bits_table`
          when a bit policy gives some buffer bits of its own.
        """
        rows = [f"{'leaf':<36}{'shape':>18}{'split on':>10}{'buckets/dev':>13}"]
        for g, x in self.leaves():
            shape = ((g.n_layers,) if g.stacked else ()) + x.shape
            split = "replicated" if x.dim is None else f"dim {x.dim + int(g.stacked)}"
            rows.append(f"{x.path:<36}{str(shape):>18}{split:>10}{x.buckets:>13}")
        if any(b.bits is not None for b in self.buffers):
            rows += ["", self.bits_table()]
        return "\n".join(rows)

    def bits_table(self, config=None) -> str:
        """The bits of every sharded leaf, buffer by buffer (``qsdp_jax._src.layout.policy.bits_table``).

        Args:
          config: the run's ``QSDPConfig``, to write out the bits of the buffers at the config's
            bits; None (the default): those are shown as ``config``.

        Returns:
          A text table with, per sharded leaf, its buffer, weight and gradient bits (``fp``
          for full precision, the config's ``fp_comm_dtype``) and element count.
        """
        return policy.bits_table(self, config)


def leaf_spec(g: GroupLayout, x: LeafLayout, axes) -> P:
    """The PartitionSpec of a leaf's global array (a stacked leaf's layer axis is never split)."""
    if x.dim is None:
        return P()
    lead = 1 if g.stacked else 0
    spec = [None] * (len(x.shape) + lead)
    spec[x.dim + lead] = axes
    return P(*spec)
