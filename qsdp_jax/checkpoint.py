"""Checkpoints of the sharded train state on orbax: exact resume, and resharding on restore.

Usage::

    with qsdp_jax.Checkpointer("runs/x/ckpt", keep=3) as ckpt:
        ckpt.save(state, config, mesh, extra={"data_position": int(state.step)})  # asynchronous
        ...
        template = qsdp_jax.init_train_state(params, opt, mesh, config, stacked=...)  # any mesh
        state, extra = ckpt.restore(template, config, mesh)   # newest complete, intact checkpoint

**What is stored.** The state's leaves are ordinary global arrays of the model's shapes
(``qsdp_jax.layout``), so they are stored as they are: the ``arrays`` item holds
``{"params": <the params dict>, "state": {leaf name: array}}`` (every other leaf: the step, the
optimizer state), and for an NNX state every leaf nested as the module and ``nnx.Optimizer``
nest them (``{"params": {"trunk": {"layers": {"0": ...}}}, "opt_state": {"0": {"mu": ...}},
"step": ..., "qsdp": ..., "model_state": ...}``). A plain orbax restore of ``arrays`` gives them
as unsharded numpy arrays. Zero-size arrays (orbax refuses them) are stored as their shape and dtype
only (:mod:`qsdp_jax._src.checkpoint.arrays`). Beside the arrays, a JSON record of what defines the checkpoint: the QSDPConfig, the
layout (groups, leaves, shapes, dtypes), the geometry of each weight grid, every leaf's shape,
the mesh shape, the library version, the step, the caller's ``identity`` (what must match) and
``extra`` (what is carried, e.g. the data position).

**Resharding.** On restore every array is placed as the template's is, so a checkpoint made on
8 devices loads on 4, on a hierarchical ``("node", "local")`` 2x4 mesh or a hybrid
``("replica", "fsdp")`` one (and back) bit for bit: the config's mesh-placement fields
(``axis_name``, ``node_axis``, ``replica_axis``) are not compared. A QSDP weight grid has one
scale and offset per bucket, and buckets live inside one device's shard: when a leaf's shard is
whole buckets of its row-major order on both meshes (split on its first dimension; true of the
usual transformer shapes) its buckets are the same on any device count, and the grid restores
exactly. Otherwise the grid belongs to the old mesh: restore refuses, naming the leaves, unless
``regrid=True`` re-projects them onto the new mesh's grid (:mod:`qsdp_jax._src.checkpoint.regrid`).
A config, layout, leaf or identity mismatch is refused with an error naming the field
(:mod:`qsdp_jax._src.checkpoint.restore`).

**Atomic.** Orbax writes a step into a temporary directory and renames it when complete; only
complete steps are listed, so a checkpoint half-written when the process died is never picked up
(and its leftovers are removed when the next manager opens the directory).

**Safe by default** (:mod:`qsdp_jax._src.checkpoint.safety`). Pending saves complete before the
process exits, also when the script never calls ``wait()``/``close()`` (a save failing then ends
the process with status 1). Every array's CRC-32 is recorded and checked on restore; a damaged
step (changed bytes, unreadable metadata, a missing part) raises :class:`CheckpointDamaged`
naming it, and ``restore()`` without a ``step`` then warns and falls back to the newest intact
step. One writer per directory: a second Checkpointer saving into it fails at once naming the
first; an unwritable directory fails the save at once, before any background write starts.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from qsdp_jax._src.checkpoint import safety
from qsdp_jax._src.checkpoint.arrays import export_state, from_item, leaf_names, to_item
from qsdp_jax._src.checkpoint.record import (
    FORMAT,
    CheckpointMismatch,
    check_format,
    describe,
    jsonable,
    library_version,
)
from qsdp_jax._src.checkpoint.restore import (
    check_restorable,
    place,
    quiet_late_reads,
    set_aside,
    short_error,
    warn_fell_back,
)
from qsdp_jax._src.checkpoint.safety import CheckpointDamaged, CheckpointLocked
from qsdp_jax.config import QSDPConfig
from qsdp_jax._src.checkpoint.regrid import regrid as regrid_state

__all__ = ["FORMAT", "CheckpointDamaged", "CheckpointLocked", "CheckpointMismatch", "Checkpointer", "export_state"]
PyTree = Any


# ----------------------------------------------------------------------------------------------
# The manager
# ----------------------------------------------------------------------------------------------
class Checkpointer:
    """Save and restore :class:`~qsdp_jax.train.TrainState` with orbax's ``CheckpointManager``.

    Use it as a context manager (or call :meth:`close`); pending saves are completed at
    interpreter exit in any case.

    An existing directory this process cannot write (a read-only mount, another user's run) is
    opened read-only: restoring works, saving raises ``OSError``.

    Args:
      directory: where step directories go (created if missing).
      keep: how many most recent complete checkpoints to keep, an integer >= 1 (default 3;
        older ones are deleted after a newer one is complete).
      async_save: write in a background thread (the default; the arrays are copied off the
        devices first, so training may go on and donate its buffers).

    Raises:
      ValueError: ``keep`` is not an integer >= 1.
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} is invalid: must be an integer >= 1")
        self.directory = Path(directory).absolute()
        # An existing directory this process cannot write (a read-only mount, another user's
        # run) is opened read-only: restore works, save fails at once naming it.
        self.read_only = self.directory.is_dir() and not os.access(self.directory, os.W_OK)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=not self.read_only,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not self.read_only,
            read_only=self.read_only,
        )
        handlers = {"arrays": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        # both handlers named up front: reading the record alone warned "Item arrays was found
        # in the checkpoint, but could not be restored" at every restore
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._lock = safety.WriterLock(self.directory)
        self._closed = False
        safety.finish_at_exit(self)

    # -- queries --
    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (complete: fully written; whether it is intact
        is checked when it is restored).

        Returns:
          The step, or None when the directory holds no complete checkpoint.
        """
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint.

        Returns:
          The steps, oldest first (empty when there is none).
        """
        self._manager.reload()
        return list(self._manager.all_steps())

    def metadata(self, step: int | None = None) -> dict:
        """The JSON record stored with a checkpoint (see the module docstring).

        Args:
          step: the checkpoint's step; None (the default): the newest complete one.

        Returns:
          The record, a dict of the config, layout, grids, leaves (shape and dtype), mesh
          shape, library version, step, ``identity``, ``extra`` and checksums.

        Raises:
          CheckpointDamaged: naming the file, when the record cannot be read.
          FileNotFoundError: no complete checkpoint (of ``step``, when given).
        """
        step = self._pick(step)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - orbax raises whatever the damaged file gives
            raise CheckpointDamaged(
                f"{self.directory / str(step) / 'meta'}: the checkpoint's "
                f"record cannot be read ({type(e).__name__}: {e})"
            ) from e
        meta = out["meta"]
        if not isinstance(meta, dict):
            raise CheckpointDamaged(f"{self.directory / str(step) / 'meta'}: not a checkpoint record")
        return meta

    # -- save / restore --
    def save(
        self,
        state,
        config: QSDPConfig,
        mesh: Mesh,
        *,
        identity: dict | None = None,
        extra: dict | None = None,
        force: bool = True,
        wait: bool = False,
    ) -> bool:
        """Save ``state`` at its step (asynchronously unless ``async_save=False`` or ``wait``).

        An asynchronous save is completed by :meth:`wait`, :meth:`close`, leaving the ``with``
        block, or the interpreter's normal exit (returning from the script, ``sys.exit``, an
        uncaught exception: the checkpoint's ``atexit`` hook waits for it). It is **lost** by an
        exit that skips ``atexit``: ``os._exit`` (what ``multiprocessing`` workers and some
        launchers end with), a signal without a handler (SIGTERM's default action, SIGKILL), a
        crash. Pass ``wait=True`` where the process may end that way right after.

        Args:
          state: the TrainState.
          config: its config.
          mesh: its mesh.
          identity: what must match on restore (e.g. the run's settings).
          extra: what is carried (e.g. the data position).
          force: passed to orbax (save whatever the save interval).
          wait: return only once this save (and any before it) is complete on disk.

        Returns:
          False if a checkpoint of that step exists already, else True.

        Raises:
          CheckpointLocked: another Checkpointer is writing into this directory (checked on
            process 0, which takes the directory's writer lock at its first save).
          OSError: the directory cannot be written (opened read-only, or no permission).
        """
        if self.read_only:
            raise OSError(
                errno.EROFS,
                f"cannot save into {self.directory}: it is not writable "
                "here (opened read-only: restore works, save does not)",
            )
        if jax.process_index() == 0:
            self._lock.acquire()
        step = int(jax.device_get(state.step))
        if step in self._manager.all_steps():  # no reload: it would race pending deletions
            return False
        arrays = export_state(state, mesh)
        meta = describe(state, config, mesh, identity)
        meta.update(
            step=step,
            mesh_shape={k: int(v) for k, v in mesh.shape.items()},
            library_version=library_version(),
            extra=jsonable(extra or {}),
            leaves={k: [list(v.shape), str(v.dtype)] for k, v in arrays.items()},
        )
        by_module = state.model_state is not None  # an NNX state: stored as the module nests it
        names = {} if by_module else leaf_names(arrays)
        meta["names"] = names
        # Host copies now (each process holds the full replicated array): the caller may donate
        # or delete the state as soon as this returns; the files are written in the background.
        host = {k: np.asarray(v.addressable_data(0)) for k, v in arrays.items()}
        meta["checksums"] = safety.checksums(host)
        stored, stored_paths = to_item(state, host, names, by_module=by_module)
        if stored_paths:
            meta["stored_paths"] = stored_paths
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(arrays=ocp.args.PyTreeSave(stored), meta=ocp.args.JsonSave(meta)),
            force=force,
        )
        if wait:
            self.wait()
        return bool(saved)

    def restore(
        self,
        template,
        config: QSDPConfig,
        mesh: Mesh,
        *,
        step: int | None = None,
        identity: dict | None = None,
        regrid: bool = False,
    ):
        """``(state, extra)`` from a checkpoint (default: the newest complete, intact one), laid
        out like ``template`` (a TrainState, concrete or abstract, for this mesh and config).

        Args:
          template: a TrainState for this mesh and config (concrete or abstract).
          config: this run's config.
          mesh: this run's mesh.
          step: the step to restore (default: the newest complete one; a damaged one is skipped
            with a warning for the next older one, and once one restores the damaged steps'
            directories are renamed ``<step>.damaged``). A given step is restored or refused,
            never replaced by another.
          identity: what must match the saved run's (e.g. its settings).
          regrid: where a weight grid's buckets differ on this mesh (see the module docstring),
            re-project those weights onto this mesh's grid by round to nearest (each moves by
            at most half a grid step, with a warning) instead of refusing. Needs a concrete
            template. Default False.

        Returns:
          A tuple ``(state, extra)`` of the restored state, every leaf placed as ``template``'s
          is, and the ``extra`` dict saved with it (``{}`` when none was given).

        Raises:
          CheckpointMismatch: naming the field, when the config (mesh-placement fields aside),
            layout, grids, leaves (structure, shapes, dtypes), ``identity`` or the checkpoint
            format differ.
          CheckpointDamaged: the step asked for is damaged, or (no step given) every one is.
          FileNotFoundError: when there is no complete checkpoint (of ``step``, when given).
        """
        self.wait()
        if step is not None:
            return self._restore_step(template, config, mesh, self._pick(step), identity, regrid)
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        damage: dict[int, str] = {}
        for s in sorted(steps, reverse=True):
            try:
                out = self._restore_step(template, config, mesh, s, identity, regrid)
            except CheckpointDamaged as e:
                damage[s] = str(e)
                continue
            if damage:
                moved = set_aside(self.directory, sorted(damage), self.read_only)
                self._manager.reload()
                warn_fell_back(self.directory, s, damage, moved)
            return out
        raise CheckpointDamaged(f"no intact checkpoint in {self.directory}: " + "; ".join(damage.values()))

    def _restore_step(self, template, config, mesh, step, identity, regrid):
        meta = self.metadata(step)
        where = f"checkpoint {self.directory}/{step}"
        moved, regridded = check_restorable(meta, template, config, mesh, identity, regrid, where)
        state = place(template, self._load(step, meta), regridded)
        if moved:
            warnings.warn(
                f"{where}: the weight grids of {moved} have other buckets on this mesh; "
                "their weights were re-projected onto it (round to nearest)",
                stacklevel=3,
            )
            state = regrid_state(state, moved, config, mesh)
        return state, meta.get("extra", {})

    def load_arrays(self, step: int | None = None) -> dict[str, np.ndarray]:
        """The stored arrays, checked against their saved checksums, e.g. to compare two runs'
        final states.

        Args:
          step: the checkpoint's step; None (the default): the newest complete one.

        Returns:
          ``{leaf path: numpy array}`` of every leaf of the saved state (zero-size ones
          included), the paths as :func:`export_state` names them.

        Raises:
          CheckpointDamaged: the step's files cannot be read or do not hold what was saved.
          CheckpointMismatch: the checkpoint was written in another format.
          FileNotFoundError: no complete checkpoint (of ``step``, when given).
        """
        step = self._pick(step)
        meta = self.metadata(step)
        check_format(meta, f"checkpoint {self.directory}/{step}")
        return self._load(step, meta)

    def _load(self, step: int, meta: dict) -> dict[str, np.ndarray]:
        where = f"checkpoint {self.directory}/{step}"
        # a damaged step's late reads would print a traceback each; named before the read, since
        # asyncio may report a dropped read's error (garbage collection) before the read fails
        quiet_late_reads(str(self.directory / str(step)))
        try:
            tree = self._manager.item_metadata(step)["arrays"]
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            got = self._manager.restore(
                step, args=ocp.args.Composite(arrays=ocp.args.PyTreeRestore(item=tree, restore_args=as_numpy))
            )["arrays"]
            out = from_item(got, meta)
        except Exception as e:  # noqa: BLE001 - whatever orbax/tensorstore raise for bad files
            raise CheckpointDamaged(f"{where}: its arrays cannot be read ({short_error(e)})") from e
        safety.verify(out, meta.get("checksums"), where)
        return out

    def wait(self) -> None:
        """Block until pending asynchronous saves are complete (re-raising a failed save).

        Raises:
          Exception: the error of a background save that failed (whatever orbax raised).
        """
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Complete pending saves, close orbax's manager and release the directory. Idempotent.

        The directory's writer lock is released even when a pending save failed.

        Raises:
          Exception: the error of a background save that failed, as :meth:`wait`.
        """
        if self._closed:
            return
        try:
            self._manager.wait_until_finished()
            self._manager.close()
        finally:
            self._closed = True
            self._lock.release()
            safety.closed(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _pick(self, step):
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(f"no complete checkpoint of step {step} in {self.directory} (have {steps})")
        return step
