"""Restoring one checkpoint step onto a template: the record checked against the template, the
arrays placed as the template's are, and damaged steps set aside.

:meth:`qsdp_jax.checkpoint.Checkpointer.restore` reads a step's record and calls
:func:`check_restorable` (format, config, layout, identity, weight grids, state structure), reads
its arrays, and :func:`place` puts each on the template's sharding (refusing another shape or
dtype). When it fell back past damaged steps, :func:`set_aside` renames their directories and
:func:`warn_fell_back` says so in one warning; :func:`quiet_late_reads` keeps the tracebacks
and errors of the skipped step's late reads off stderr.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from qsdp_jax._src.checkpoint.record import (
    CheckpointMismatch,
    check_format,
    check_match,
    comparable,
    describe,
    moved_grids,
    refuse_grids,
)
from qsdp_jax._src.checkpoint.regrid import grid_leaf_keys
from qsdp_jax._src.quant.weight_codes import holds_codes


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


def set_aside(directory: Path, steps: list[int], read_only: bool) -> list[str]:
    """Rename damaged step directories to ``<step>.damaged`` (kept for a person to look at),
    so that the resumed run saves those steps afresh instead of skipping them as existing.

    Process 0 renames (unless the directory was opened read-only); every process then waits for
    the others. Returns the new names (none on other processes). The caller reloads its
    manager's list of steps afterwards.
    """
    moved = []
    if not read_only and jax.process_index() == 0:
        for s in steps:
            target = directory / f"{s}.damaged"
            n = 1
            while target.exists():
                target, n = directory / f"{s}.damaged.{n}", n + 1
            (directory / str(s)).rename(target)
            moved.append(target.name)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"qsdp_jax checkpoint set aside {steps}")
    return moved


def warn_fell_back(directory: Path, step: int, damage: dict[int, str], moved: list[str]) -> None:
    """The one warning of a restore that skipped damaged steps for ``step``."""
    aside = f"; moved aside to {moved} (delete once looked at)" if moved else ""
    warnings.warn(
        f"restored step {step} from {directory}, the newest intact checkpoint: skipped "
        + "; ".join(f"step {s} ({why})" for s, why in sorted(damage.items(), reverse=True))
        + aside,
        stacklevel=3,
    )


def short_error(e: BaseException, limit: int = 300) -> str:
    """An orbax/tensorstore error in a line: its type and text up to its tensorstore spec."""
    text = str(e).split(" [tensorstore_spec=")[0].splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:limit]}"


_DAMAGED: set[str] = set()  # step directories whose arrays failed to read in this process
_READ = {"any": False}  # whether this process has read a checkpoint's arrays


def _closed_loop_report(report) -> bool:
    """One of the reports tensorstore makes when a read finishes after orbax closed the event
    loop it was awaited in (orbax closes it as soon as one read of a damaged step fails)."""
    return (
        _READ["any"]  # only once this process has read a checkpoint
        and report.object is None
        and isinstance(report.exc_value, RuntimeError)
        and str(report.exc_value) == "Event loop is closed"
    )


class _LateReadErrors(logging.Filter):
    """asyncio's "Future/Task exception was never retrieved" for a read of a damaged step (the
    reads orbax left behind when it gave the step up); other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or "exception was never retrieved" not in record.getMessage():
            return True
        return not any(d in str(exc) for d in _DAMAGED)


def quiet_late_reads(damaged: str | None = None) -> None:
    """Keep a damaged step's late reads off stderr: tensorstore's "Event loop is closed" reports
    (a traceback each, up to 42 for one step) and asyncio's never-retrieved errors naming
    ``damaged`` (a step directory about to be read, remembered: asyncio may report a dropped
    read's error before the restore fails; a step that reads whole leaves no such error). Every
    other unraisable exception goes to the hook there was, every other log record through. The
    hooks are installed once."""
    _READ["any"] = True
    if damaged is not None:
        _DAMAGED.add(damaged)
    previous = sys.unraisablehook
    if not getattr(previous, "_qsdp_quiet", False):

        def hook(report):
            if not _closed_loop_report(report):
                previous(report)

        hook._qsdp_quiet = True  # type: ignore[attr-defined]
        sys.unraisablehook = hook
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _LateReadErrors) for f in log.filters):
        log.addFilter(_LateReadErrors())
