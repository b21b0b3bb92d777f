"""Meshes for FSDP: 1-D, hierarchical ``(node, local)`` and hybrid ``(replica, fsdp)``.

:func:`make_mesh` orders the devices hosts-outermost, so the first axis of a 2-D mesh is the slow
(inter-node) level. How each parameter leaf is sharded over a mesh is :mod:`qsdp_jax.layout`'s.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh


PyTree = Any


def make_mesh(axes: str | Mapping[str, int] = "fsdp", devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all devices of all processes).

    * ``make_mesh()`` / ``make_mesh("fsdp")``: 1-D on one axis (the simple default).
    * ``make_mesh({"node": 2, "local": 4})``: hierarchical FSDP (``QSDPConfig(node_axis="node",
      axis_name="local")``); ``make_mesh({"replica": 2, "fsdp": 4})``: hybrid sharding
      (``QSDPConfig(replica_axis="replica")``). The first axis is the outer (slow) level.

    With a mapping the devices are ordered hosts-outermost: consecutive positions of the last
    axis are devices of the same process wherever they divide that way, so the outer axis is
    the one that crosses hosts (on CPU the devices are grouped by ``process_index``; on GPU/TPU
    JAX's ``mesh_utils.create_device_mesh`` / ``create_hybrid_device_mesh`` choose the order).
    On several TPU slices (a multislice job) the outer axis crosses the slices, the data-center
    network, whenever its size is a multiple of the slice count.
    A 1-D mesh from an axis name keeps the order of ``devices``. Uses ``AxisType.Auto`` (the
    classic style): shardings are given explicitly where they matter.

    Args:
      axes: an axis name (a 1-D mesh over every device; default ``"fsdp"``), or a mapping of
        one or two axis names to sizes, outer axis first, whose sizes (integers >= 1) multiply
        to the device count.
      devices: the devices to use (default: ``jax.devices()``, those of all processes).

    Returns:
      The ``jax.sharding.Mesh``.

    Raises:
      ValueError: no devices; ``axes`` neither a name nor a non-empty mapping; more than two
        axes; an axis name that is not a non-empty string; a size that is not an integer >= 1;
        sizes that do not multiply to the device count.
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

        nslices = len({getattr(d, "slice_index", 0) for d in devs})
        if nslices > 1 and len(shape) == 2 and shape[0] % nslices == 0:  # TPU slices over DCN
            return mesh_utils.create_hybrid_device_mesh((shape[0] // nslices, shape[1]), (nslices, 1), devs)
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
    against their config by :func:`qsdp_jax._src.collective.hierarchy.mesh_sizes` instead; this helper
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
            "use qsdp_jax._src.collective.hierarchy.mesh_sizes(mesh, config), which checks it against "
            "QSDPConfig.node_axis / replica_axis"
        )
    return mesh.shape[axis_name]
