"""Restoring one checkpoint step onto a template: the record checked against the template, the
arrays placed as the template's are, and damaged steps set aside.

:meth:`qsdp_jax.checkpoint.Checkpointer.restore` reads a step's record and calls
:func:`check_restorable` (format, config, layout, identity, weight grids, state structure), reads
its arrays, and :func:`place` puts each on the template's sharding (refusing another shape or
dtype). When it fell back past damaged steps, :func:`set_aside` renames their directories.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from qsdp_jax._src.checkpoint_record import (
    CheckpointMismatch,
    check_format,
    check_match,
    comparable,
    describe,
    moved_grids,
    refuse_grids,
)
from qsdp_jax._src.regrid import grid_leaf_keys
from qsdp_jax._src.weight_codes import holds_codes


def check_restorable(meta: dict, template, config, mesh, identity, regrid: bool, where: str):
    """Refuse a checkpoint record ``meta`` that does not fit ``template`` on this mesh and config.

    Returns:
      ``(moved, regridded)``: the groups whose weight grids have other buckets on this mesh
      (only with ``regrid``; else they are refused) and the template's leaf paths that regrid
      fills instead of the checkpoint.

    Raises:
      CheckpointMismatch: naming the field, when the format, config (mesh-placement fields
        aside), layout, ``identity``, grids (without ``regrid``) or the state's leaves differ.
    """
    check_format(meta, where)
    wanted = describe(template, config, mesh, identity)
    keys = ("format", "config", "layout", "identity")
    check_match(comparable({k: meta.get(k) for k in keys}), comparable({k: wanted[k] for k in keys}), where=where)
    moved = moved_grids(meta.get("grids", {}), wanted["grids"])
    if moved and holds_codes(config):
        raise CheckpointMismatch(
            f"{where}: the weight grids of {moved} have other buckets on this mesh, and "
            "code-held weights (weight_storage='codes') are the codes of the checkpoint's grid: "
            "restore on the checkpoint's mesh shape (regrid=True cannot move codes)"
        )
    if moved and not regrid:
        refuse_grids(meta.get("grids", {}), wanted["grids"], moved, where)
    regridded = grid_leaf_keys(template, moved) if moved else set()
    want = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(template)[0]}
    missing = sorted(want - set(meta["leaves"]) - regridded)
    unexpected = sorted(set(meta["leaves"]) - want)
    if missing or unexpected:
        raise CheckpointMismatch(
            f"{where} holds another state structure: missing "
            f"{missing[:3]}, unexpected {unexpected[:3]} (a different optimizer or model?)"
        )
    return moved, regridded


def place(template, arrays: dict[str, np.ndarray], regridded: set[str]):
    """The state of ``template``'s structure with each leaf ``arrays[path]`` placed on the
    template leaf's sharding (a ``regridded`` leaf keeps the template's, for regrid to fill).

    Raises:
      CheckpointMismatch: a stored array of another shape or dtype than the template's leaf.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, like in leaves:
        key = jax.tree_util.keystr(path)
        if key in regridded:  # a grid of this mesh's buckets, filled by regrid below
            out.append(like)
            continue
        host = arrays[key]
        if tuple(host.shape) != tuple(like.shape):
            raise CheckpointMismatch(f"{key}: the checkpoint holds shape {host.shape}, this state needs {like.shape}")
        if str(host.dtype) != str(like.dtype):
            raise CheckpointMismatch(f"{key}: the checkpoint holds {host.dtype}, this state needs {like.dtype}")
        out.append(to_device(host, like.sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def to_device(host: np.ndarray, sharding) -> jax.Array:
    """A global array of ``host``'s values laid out by ``sharding`` (every process holds all of
    ``host``)."""
    host = np.array(host, order="C", copy=True)  # (ascontiguousarray would make 0-d arrays 1-d)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def set_aside(directory: Path, steps: list[int], read_only: bool) -> None:
    """Rename damaged step directories to ``<step>.damaged`` (kept for a person to look at),
    so that the resumed run saves those steps afresh instead of skipping them as existing.

    Process 0 renames (unless the directory was opened read-only) and warns; every process then
    waits for the others. The caller reloads its manager's list of steps afterwards.
    """
    if not read_only and jax.process_index() == 0:
        moved = []
        for s in steps:
            target = directory / f"{s}.damaged"
            n = 1
            while target.exists():
                target, n = directory / f"{s}.damaged.{n}", n + 1
            (directory / str(s)).rename(target)
            moved.append(target.name)
        warnings.warn(
            f"moved the damaged checkpoint(s) aside in {directory}: {moved} (delete them once looked at)",
            stacklevel=3,
        )
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"qsdp_jax checkpoint set aside {steps}")
