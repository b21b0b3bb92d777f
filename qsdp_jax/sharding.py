"""Meshes and the sharded layout of a parameter pytree.

Layout (FSDP's FlatParameter idea): parameters are a dict of *groups*. In each group, every
leaf with at least ``min_shard_size`` elements (per layer, for a layer-stacked group) is
flattened into one float32 buffer, each leaf padded to whole buckets so that no bucket spans two
leaves, and the buffer is padded to a multiple of ``num_shards * bucket`` so that every device
holds the same number of whole buckets. The buffer is sharded over the FSDP axis: device ``i``
holds elements ``[i * chunk, (i + 1) * chunk)``. Any shape works this way (a 7x13 matrix on 8
devices is 91 elements in a 8 * bucket buffer). Smaller leaves (biases, norm scales) stay
full precision and replicated on every device. One buffer per group (per layer) means one
collective per group, whatever its number of leaves: quantization is batched, and the compiled
step stays small.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from qsdp_jax import policy
from qsdp_jax.policy import Buffer

PyTree = Any


def make_mesh(
    axes: str | Mapping[str, int] = "fsdp", devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A mesh over ``devices`` (default: all devices of all processes).

    * ``make_mesh()`` / ``make_mesh("fsdp")``: 1-D on one axis (the simple default).
    * ``make_mesh({"node": 2, "local": 4})``: hierarchical FSDP (``QSDPConfig(node_axis="node",
      axis_name="local")``); ``make_mesh({"replica": 2, "fsdp": 4})``: hybrid sharding
      (``QSDPConfig(replica_axis="replica")``). The first axis is the outer (slow) level.

    Devices are ordered hosts-outermost: consecutive positions of the last axis are devices of
    the same process wherever they divide that way, so the outer axis is the one that crosses
    hosts (on CPU the devices are grouped by ``process_index``; on GPU/TPU JAX's
    ``mesh_utils.create_device_mesh`` / ``create_hybrid_device_mesh`` choose the order).
    Uses ``AxisType.Auto`` (the classic style): shardings are given explicitly where they matter.
    """
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("make_mesh needs at least one device")
    if isinstance(axes, str):
        return Mesh(np.array(devs), (axes,), axis_types=(jax.sharding.AxisType.Auto,))
    names, shape = _mesh_shape(axes, len(devs))
    return Mesh(_order_devices(devs, shape), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _mesh_shape(axes, num_devices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if not isinstance(axes, Mapping) or not axes:
        raise ValueError(
            f"make_mesh axes must be an axis name or a non-empty dict name -> size, e.g. "
            f"{{'node': 2, 'local': 4}}; got {axes!r}"
        )
    names, shape = tuple(axes), tuple(axes.values())
    if len(names) > 2:
        raise ValueError(f"make_mesh supports 1-D and 2-D meshes, got {len(names)} axes {names}")
    for name, size in axes.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"mesh axis names must be non-empty strings, got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} has size {size!r}: must be an integer >= 1")
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"mesh {dict(axes)} needs {' x '.join(map(str, shape))} = {math.prod(shape)} devices, "
            f"but there are {num_devices}: the sizes must multiply to the device count"
        )
    return names, shape


def _order_devices(devs: list, shape: tuple[int, ...]) -> np.ndarray:
    """Devices in a ``shape`` array, hosts outermost (see :func:`make_mesh`)."""
    devs = sorted(devs, key=lambda d: (d.process_index, d.id))
    if devs[0].platform != "cpu":
        from jax.experimental import mesh_utils

        nproc = len({d.process_index for d in devs})
        if nproc > 1 and len(shape) == 2 and shape[0] % nproc == 0:
            return mesh_utils.create_hybrid_device_mesh(
                (shape[0] // nproc, shape[1]), (nproc, 1), devs, process_is_granule=True
            )
        return mesh_utils.create_device_mesh(shape, devs, allow_split_physical_axes=True)
    return np.array(devs, dtype=object).reshape(shape)


def check_mesh(mesh: Mesh, axis_name: str) -> int:
    """The size of ``axis_name`` in a 1-D ``mesh``; a clear error if the axis is missing.

    Multi-axis meshes (hierarchical ``node_axis`` / hybrid ``replica_axis``) are checked
    against their config by :func:`qsdp_jax.hierarchy.mesh_sizes` instead; this helper
    points there rather than guessing which axes shard the weights.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"mesh has no axis {axis_name!r} (its axes are {mesh.axis_names}); build it with "
            f"qsdp_jax.make_mesh({axis_name!r}) or set QSDPConfig.axis_name"
        )
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"check_mesh handles 1-D meshes only, got axes {mesh.axis_names}; for a 2-D mesh "
            "use qsdp_jax.hierarchy.mesh_sizes(mesh, config), which checks it against "
            "QSDPConfig.node_axis / replica_axis"
        )
    return mesh.shape[axis_name]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one sharded leaf lives in its group's flat buffer (per layer)."""

    index: int  # position among the group's leaves (treedef order)
    shape: tuple[int, ...]  # per-layer shape
    dtype: str
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One parameter group. ``slots`` / ``flat_size`` / ``chunk`` describe its buffer at the
    config's bits (keyed by the group's name); a bit policy adds ``policy_buffers``."""

    name: str
    stacked: bool
    n_layers: int  # 0 for a non-stacked group
    treedef: Any
    num_leaves: int
    slots: tuple[Slot, ...]  # sharded leaves at the config's bits
    replicated: tuple[int, ...]  # leaf indices kept replicated
    flat_size: int  # padded length of the flat buffer (per layer); 0 if nothing is sharded
    chunk: int  # flat_size // num_shards
    policy_buffers: tuple[Buffer, ...] = ()  # buffers of leaves a bit policy gives other bits

    @property
    def is_sharded(self) -> bool:
        return self.flat_size > 0 or bool(self.policy_buffers)

    @property
    def real_size(self) -> int:
        return sum(s.size for b in self.buffers for s in b.slots)

    @property
    def held_size(self) -> int:
        """Padded elements of all the group's buffers (per layer)."""
        return sum(b.flat_size for b in self.buffers)

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        """Every flat buffer of the group: the one at the config's bits (if it holds leaves),
        then the policy's."""
        main = ()
        if self.flat_size > 0:
            main = (Buffer(self.name, self.name, 0, None, self.slots, self.flat_size, self.chunk,
                           self.stacked, self.n_layers),)
        return main + self.policy_buffers

    def leaf_paths(self) -> list[str]:
        """The ``qsdp_jax.policy`` path of every leaf, in treedef order."""
        tree = jax.tree_util.tree_unflatten(self.treedef, [0] * self.num_leaves)
        return policy.tree_paths(self.name, tree)


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """The map between a parameter dict and its sharded state (see module docstring)."""

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
    ) -> "FlatLayout":
        """The layout of ``params`` (see the module docstring). ``bit_policy``
        (``QSDPConfig.bit_policy``) puts the sharded leaves a rule gives other bits than
        ``default_bits`` (the config's ``(weight_bits, grad_bits)``) into buffers of their own;
        a rule that matches no sharded leaf is a ``ValueError``."""
        if not isinstance(params, dict) or not params:
            raise ValueError("params must be a non-empty dict of groups, e.g. {'embed': ..., 'blocks': ...}")
        unknown = set(stacked) - set(params)
        if unknown:
            raise ValueError(f"stacked groups {sorted(unknown)} are not in params (groups: {sorted(params)})")
        groups, sharded_paths, replicated_paths = [], [], []
        for name in sorted(params):
            leaves, treedef = jax.tree_util.tree_flatten(params[name])
            paths = policy.tree_paths(name, params[name]) if bit_policy else []
            is_stacked = name in stacked
            n_layers = 0
            if is_stacked:
                dims = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
                if len(dims) != 1 or None in dims:
                    raise ValueError(
                        f"stacked group {name!r} needs the same leading layer axis on every leaf, "
                        f"got leading dims {sorted(map(str, dims))}"
                    )
                n_layers = dims.pop()
            by_bits: dict = {None: ([], 0)}
            replicated = []
            for i, x in enumerate(leaves):
                shape = tuple(np.shape(x)[1:] if is_stacked else np.shape(x))
                size = math.prod(shape)
                dtype = _dtype(x)
                if not jnp.issubdtype(dtype, jnp.floating) or size < min_shard_size or size == 0:
                    replicated.append(i)
                    replicated_paths += paths[i : i + 1]
                    continue
                bits = policy.leaf_bits(bit_policy, paths[i]) if bit_policy else None
                bits = None if bits == default_bits else bits
                sharded_paths += paths[i : i + 1]
                slots, offset = by_bits.get(bits, ([], 0))
                by_bits[bits] = (slots + [Slot(i, shape, str(dtype), offset, size)],
                                 offset + _round_up(size, bucket))
            slots, offset = by_bits.pop(None)
            flat = _round_up(offset, num_shards * bucket) if slots else 0
            extra = []
            for j, bits in enumerate(sorted(by_bits, key=policy.bits_label), start=1):
                b_slots, b_offset = by_bits[bits]
                b_flat = _round_up(b_offset, num_shards * bucket)
                extra.append(Buffer(policy.buffer_key(name, bits), name, j, bits, tuple(b_slots),
                                    b_flat, b_flat // num_shards, is_stacked, n_layers))
            groups.append(
                GroupLayout(
                    name=name, stacked=is_stacked, n_layers=n_layers, treedef=treedef,
                    num_leaves=len(leaves), slots=tuple(slots), replicated=tuple(replicated),
                    flat_size=flat, chunk=flat // num_shards, policy_buffers=tuple(extra),
                )
            )
        if bit_policy:
            policy.check_rules_match(bit_policy, sharded_paths, replicated_paths)
        return cls(groups=tuple(groups), num_shards=num_shards, bucket=bucket)

    def group(self, name: str) -> GroupLayout:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"unknown parameter group {name!r}; groups are {[g.name for g in self.groups]}")

    def group_index(self, name: str) -> int:
        return [g.name for g in self.groups].index(self.group(name).name)

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        """Every flat buffer, group by group (the keys of ``params["sharded"]``)."""
        return tuple(b for g in self.groups for b in g.buffers)

    def buffer(self, key: str) -> Buffer:
        for b in self.buffers:
            if b.key == key:
                return b
        raise KeyError(f"unknown flat buffer {key!r}; buffers are {[b.key for b in self.buffers]}")

    def leaf_paths(self) -> dict[str, list[str]]:
        """``{group: [leaf path, ...]}``: the paths a ``QSDPConfig.bit_policy`` matches."""
        return {g.name: g.leaf_paths() for g in self.groups}

    # --- pytree <-> flat -----------------------------------------------------------------------
    def flatten(self, params: dict[str, PyTree]) -> dict[str, dict]:
        """``{"sharded": {buffer key: flat}, "replicated": {group: tuple of leaves}}``.

        ``flat`` is (flat_size,) or (n_layers, flat_size) float32; a group's buffer is keyed by
        its name (a bit policy adds ``"group@W8G8"`` buffers).
        """
        sharded, replicated = {}, {}
        for g in self.groups:
            leaves = jax.tree_util.tree_leaves(params[g.name])
            if len(leaves) != g.num_leaves:
                raise ValueError(f"group {g.name!r} has {len(leaves)} leaves, the layout expects {g.num_leaves}")
            replicated[g.name] = tuple(jnp.asarray(leaves[i]) for i in g.replicated)
            for b in g.buffers:
                lead = (g.n_layers,) if g.stacked else ()
                parts = []
                for s in b.slots:
                    x = jnp.asarray(leaves[s.index], jnp.float32).reshape(*lead, s.size)
                    parts.append(_pad_to(x, _round_up(s.size, self.bucket)))
                flat = jnp.concatenate(parts, axis=-1)
                sharded[b.key] = _pad_to(flat, b.flat_size)
        return {"sharded": sharded, "replicated": replicated}

    def unflatten_group(self, name: str, flat, replicated: tuple) -> PyTree:
        """One group's pytree from its full flat buffer(s) and its replicated leaves (with the
        same leading axes). ``flat``: ``{buffer key: buffer}`` (``(flat_size,)``, or with
        leading layer axes), or the one buffer of a group without policy buffers."""
        g = self.group(name)
        leaves: list = [None] * g.num_leaves
        for i, x in zip(g.replicated, replicated):
            leaves[i] = x
        buffers = g.buffers
        if not isinstance(flat, Mapping):
            if len(buffers) > 1:
                raise ValueError(f"group {name!r} has buffers {[b.key for b in buffers]}: pass a dict")
            flat = {b.key: flat for b in buffers}
        for b in buffers:
            lead = flat[b.key].shape[:-1]
            pieces = split_flat(flat[b.key], tuple((s.offset, s.size) for s in b.slots))
            for s, x in zip(b.slots, pieces):
                leaves[s.index] = x.reshape(*lead, *s.shape).astype(s.dtype)
        return jax.tree_util.tree_unflatten(g.treedef, leaves)

    def unflatten(self, state_params: dict[str, dict]) -> dict[str, PyTree]:
        """Inverse of :func:`flatten` (on full, gathered buffers)."""
        return {
            g.name: self.unflatten_group(
                g.name, {b.key: state_params["sharded"][b.key] for b in g.buffers},
                state_params["replicated"][g.name],
            )
            for g in self.groups
        }

    # --- shardings -----------------------------------------------------------------------------
    def specs(self, axis_name: str) -> dict[str, dict]:
        """PartitionSpecs of the flattened state: buffers sharded on their last axis."""
        sharded = {b.key: (P(None, axis_name) if b.stacked else P(axis_name)) for b in self.buffers}
        replicated = {g.name: tuple(P() for _ in g.replicated) for g in self.groups}
        return {"sharded": sharded, "replicated": replicated}

    def shardings(self, mesh: Mesh, axis_name: str) -> dict[str, dict]:
        return jax.tree.map(
            lambda spec: NamedSharding(mesh, spec), self.specs(axis_name),
            is_leaf=lambda x: isinstance(x, P),
        )

    def table(self) -> str:
        """A readable summary: per group, sharded elements, padding, replicated leaves."""
        rows = [f"{'group':<14}{'layers':>7}{'sharded':>12}{'padded':>12}{'replicated':>12}"]
        for g in self.groups:
            rows.append(
                f"{g.name:<14}{g.n_layers:>7}{g.real_size:>12}{g.held_size:>12}{len(g.replicated):>12}"
            )
        if any(g.policy_buffers for g in self.groups):
            rows += ["", self.bits_table()]
        return "\n".join(rows)

    def bits_table(self, config=None) -> str:
        """The bits of every sharded leaf, buffer by buffer (see ``qsdp_jax.policy.bits_table``)."""
        return policy.bits_table(self, config)


def split_flat(flat: jax.Array, spans: tuple[tuple[int, int], ...]) -> tuple[jax.Array, ...]:
    """The pieces ``flat[..., offset : offset + size]`` for ``(offset, size)`` in ``spans``
    (increasing, non-overlapping).

    Differentiable like the slices, but its transpose is one concatenation of the cotangents
    with zeros in the gaps. The slices' own transpose pads every cotangent to the full buffer
    and adds them up: one buffer-sized temporary and add per leaf, which XLA:CPU kept
    unfused in the quantized step (6 per layer of the small GPT, measured as a large part of
    the quantized step's overhead).
    """
    return _split(flat, tuple(spans), flat.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _split(flat, spans, total):
    return tuple(flat[..., o : o + n] for o, n in spans)


def _split_fwd(flat, spans, total):
    return _split(flat, spans, total), None


def _split_bwd(spans, total, _, cts):
    lead, dtype = cts[0].shape[:-1], cts[0].dtype
    parts, end = [], 0
    for (o, n), ct in zip(spans, cts):
        if o > end:
            parts.append(jnp.zeros((*lead, o - end), dtype))
        parts.append(jnp.asarray(ct, dtype))
        end = o + n
    if total > end:
        parts.append(jnp.zeros((*lead, total - end), dtype))
    return (jnp.concatenate(parts, axis=-1),)


_split.defvjp(_split_fwd, _split_bwd)


def _dtype(x) -> np.dtype:
    """The dtype of an array, a ShapeDtypeStruct or a Python scalar."""
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _pad_to(x: jax.Array, n: int) -> jax.Array:
    pad = n - x.shape[-1]
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
