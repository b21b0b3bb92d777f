"""Checkpoints of the sharded train state on orbax: exact resume, and resharding on restore.

Usage::

    ckpt = qsdp_jax.Checkpointer("runs/x/ckpt", keep=3)
    ckpt.save(state, config, mesh, extra={"data_position": int(state.step)})   # asynchronous
    ...
    template = qsdp_jax.init_train_state(params, opt, mesh, config, stacked=...)  # any mesh
    state, extra = ckpt.restore(template, config, mesh)          # latest complete checkpoint

**What is stored.** The state's leaves are ordinary global arrays of the model's shapes
(``qsdp_jax.sharding``), so they are stored as they are: the ``arrays`` item holds
``{"params": <the params dict>, "state": {leaf path: array}}`` (every other leaf: the step, the
optimizer state, the model state). A plain orbax restore of ``arrays`` gives the params pytree as
unsharded numpy arrays. Zero-size arrays (orbax refuses them) are stored as their shape and dtype
only. Beside the arrays, a JSON record of what defines the checkpoint: the QSDPConfig, the
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
``regrid=True`` re-projects them onto the new mesh's grid (:mod:`qsdp_jax.regrid`).
A config, layout, leaf or identity mismatch is refused with an error naming the field.

**Atomic.** Orbax writes a step into a temporary directory and renames it when complete; only
complete steps are listed, so a checkpoint half-written when the process died is never picked up
(and its leftovers are removed when the next manager opens the directory).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from qsdp_jax.config import QSDPConfig
from qsdp_jax.regrid import grid_leaf_keys
from qsdp_jax.regrid import regrid as regrid_state
from qsdp_jax.sharding import ParamLayout

FORMAT = 2
PyTree = Any


class CheckpointMismatch(ValueError):
    """The checkpoint was made for another config, model or run; the message names the field."""


def library_version() -> str:
    try:
        return importlib.metadata.version("qsdp_jax")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source checkout
        return "unknown"


FORMAT_NAMES = {1: "flat per-layer buffers (qsdp_jax before the per-parameter layout)"}


def export_state(state, mesh: Mesh) -> dict[str, jax.Array]:
    """``{leaf path: array}`` of every leaf of ``state``, replicated on ``mesh``."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    out = _replicate(mesh)([x for _, x in leaves])
    return {jax.tree_util.keystr(p): x for (p, _), x in zip(leaves, out)}


_REPLICATE: dict = {}


def _replicate(mesh: Mesh):
    fn = _REPLICATE.get(mesh)
    if fn is None:
        _REPLICATE.clear()  # one mesh per process in practice; keep memory bounded
        fn = _REPLICATE[mesh] = jax.jit(lambda xs: xs, out_shardings=NamedSharding(mesh, P()))
    return fn


def _is_param(key: str) -> bool:
    """A params leaf (stored in the ``arrays`` item's params pytree, not under ``state``)."""
    return key.startswith(".params")


# ----------------------------------------------------------------------------------------------
# What defines a checkpoint
# ----------------------------------------------------------------------------------------------
def describe_layout(layout: ParamLayout) -> dict:
    """The device-count-independent part of a layout (the model's shape as the state sees it)."""
    return {
        "bucket": layout.bucket,
        "groups": {
            g.name: {
                "stacked": g.stacked,
                "n_layers": g.n_layers,
                "treedef": str(g.treedef),
                "leaves": [[x.path, list(x.shape), x.dtype] for x in g.leaves],
            }
            for g in layout.groups
        },
    }


def describe_grids(layout: ParamLayout, config: QSDPConfig) -> dict:
    """``{leaf path: geometry}`` of every weight grid (``"qsdp"`` mode): ``"row-major"`` where
    the buckets do not depend on the device count, else the split and the shard count."""
    if config.weight_mode != "qsdp":
        return {}
    out = {}
    for (g, x), bits in zip(layout.leaves(), layout.weight_bits(config)):
        if bits is None:
            continue
        if x.dim == 0 and x.local_size % layout.bucket == 0:
            out[x.path] = "row-major"
        else:
            out[x.path] = f"dim {x.dim} over {layout.num_shards} shards, {x.buckets} buckets each"
    return out


def _config_record(config: QSDPConfig) -> dict:
    """The config as stored; ``bit_policy`` only when set, so that checkpoints made before the
    field existed compare equal to a policy-less config (and a policy is a named mismatch)."""
    record = dataclasses.asdict(config)
    if not config.bit_policy:
        record.pop("bit_policy")
    else:
        record["bit_policy"] = [list(r) for r in config.bit_policy]
    return record


def describe(state, config: QSDPConfig, mesh: Mesh, identity: dict | None = None) -> dict:
    """What must match for a checkpoint of ``state`` to load into a run (see :func:`check_match`)."""
    if not isinstance(config, QSDPConfig):
        raise TypeError(f"config must be a QSDPConfig, got {type(config).__name__}")
    return {
        "format": FORMAT,
        "config": _config_record(config),
        "layout": describe_layout(state.layout),
        "grids": describe_grids(state.layout, config),
        "identity": _jsonable(identity or {}),
    }


# Where the state lives, not what it is: a checkpoint loads onto another mesh shape (1-D fsdp,
# hierarchical node x local) with other axis names.
PLACEMENT_FIELDS = ("axis_name", "node_axis", "replica_axis")


def _comparable(record: dict) -> dict:
    """``record`` (from :func:`describe`) without the config's mesh-placement fields."""
    config = {k: v for k, v in (record.get("config") or {}).items() if k not in PLACEMENT_FIELDS}
    return {**record, "config": config}


def check_match(saved: dict, wanted: dict, where: str = "checkpoint") -> None:
    """Raise :class:`CheckpointMismatch` naming the first field where ``saved`` and ``wanted``
    differ (dotted path, both values)."""
    diff = _first_difference(saved, wanted, "")
    if diff is not None:
        field, a, b = diff
        raise CheckpointMismatch(
            f"{where} does not match this run: {field} is {a!r} in the checkpoint but {b!r} here; "
            "resume with the same settings, or start a fresh run in another directory"
        )


def _first_difference(a, b, prefix: str):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            name = f"{prefix}.{k}" if prefix else str(k)
            if k not in a:
                return name, "<absent>", b[k]
            if k not in b:
                return name, a[k], "<absent>"
            d = _first_difference(a[k], b[k], name)
            if d is not None:
                return d
        return None
    return None if a == b else (prefix, a, b)


def _check_format(meta: dict, where: str) -> None:
    if meta.get("format") != FORMAT:
        old = FORMAT_NAMES.get(meta.get("format"), f"format {meta.get('format')!r}")
        raise CheckpointMismatch(
            f"{where} was written in {old}; this version of qsdp_jax reads format {FORMAT} "
            "(per-parameter leaves): restore it with the version that wrote it, or start afresh")


def _moved_grids(saved: dict, wanted: dict) -> list[str]:
    """The leaves whose QSDP grid has other buckets here (see the module docstring)."""
    return sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))


def _refuse_grids(saved: dict, wanted: dict, moved: list[str], where: str) -> None:
    k = moved[0]
    raise CheckpointMismatch(
        f"{where}: the weight grid of {len(moved)} leaves has other buckets on this mesh "
        f"({k}: {saved.get(k, 'no grid')!r} in the checkpoint, {wanted.get(k, 'no grid')!r} "
        "here): a grid restores exactly only where a leaf's shard is whole buckets of its "
        "row-major order on both meshes. Restore on the checkpoint's mesh shape, or pass "
        "regrid=True to re-project those weights onto this mesh's grid (round to nearest)"
    )


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


# ----------------------------------------------------------------------------------------------
# The manager
# ----------------------------------------------------------------------------------------------
class Checkpointer:
    """Save and restore :class:`~qsdp_jax.train.TrainState` with orbax's ``CheckpointManager``.

    Args:
      directory: where step directories go (created if missing).
      keep: how many most recent complete checkpoints to keep (older ones are deleted after a
        newer one is complete).
      async_save: write in a background thread (the arrays are copied off the devices first,
        so training may go on and donate its buffers).
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} is invalid: must be an integer >= 1")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("arrays", "meta"))

    # -- queries --
    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        self._manager.reload()
        return list(self._manager.all_steps())

    def metadata(self, step: int | None = None) -> dict:
        """The JSON record stored with a checkpoint (default: the latest)."""
        step = self._pick(step)
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return out["meta"]

    # -- save / restore --
    def save(self, state, config: QSDPConfig, mesh: Mesh, *, identity: dict | None = None,
             extra: dict | None = None, force: bool = True) -> bool:
        """Save ``state`` at its step (asynchronously unless ``async_save=False``).

        ``identity`` must match on restore; ``extra`` is carried (e.g. the data position).
        Returns False if a checkpoint of that step exists already.
        """
        step = int(jax.device_get(state.step))
        if step in self._manager.all_steps():  # no reload: it would race pending deletions
            return False
        arrays = export_state(state, mesh)
        meta = describe(state, config, mesh, identity)
        meta.update(
            step=step, mesh_shape={k: int(v) for k, v in mesh.shape.items()},
            library_version=library_version(), extra=_jsonable(extra or {}),
            leaves={k: [list(v.shape), str(v.dtype)] for k, v in arrays.items()},
        )
        names = {k: f"leaf_{i:04d}" for i, k in enumerate(arrays) if not _is_param(k)}
        meta["names"] = names
        # Host copies now (each process holds the full replicated array): the caller may donate
        # or delete the state as soon as this returns; the files are written in the background.
        host = {k: np.asarray(v.addressable_data(0)) for k, v in arrays.items()}
        params = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(state.params),
            [host[".params" + jax.tree_util.keystr(p)]
             for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]])
        stored = {"params": params, "state": {names[k]: v for k, v in host.items() if k in names and v.size}}
        return bool(self._manager.save(
            step, args=ocp.args.Composite(arrays=ocp.args.PyTreeSave(stored), meta=ocp.args.JsonSave(meta)),
            force=force,
        ))

    def restore(self, template, config: QSDPConfig, mesh: Mesh, *, step: int | None = None,
                identity: dict | None = None, regrid: bool = False):
        """``(state, extra)`` from a checkpoint (default: the latest complete one), laid out
        like ``template`` (a TrainState, concrete or abstract, for this mesh and config).

        Args:
          template: a TrainState for this mesh and config (concrete or abstract).
          config: this run's config.
          mesh: this run's mesh.
          step: the step to restore (default: the newest complete one).
          identity: what must match the saved run's (e.g. its settings).
          regrid: where a weight grid's buckets differ on this mesh (see the module docstring),
            re-project those weights onto this mesh's grid by round to nearest (each moves by
            at most half a grid step) instead of refusing. Needs a concrete template.

        Raises:
          CheckpointMismatch: naming the field, when the config, layout, grids, leaves or
            ``identity`` differ.
          FileNotFoundError: when there is no complete checkpoint.
        """
        self.wait()
        step = self._pick(step)
        meta = self.metadata(step)
        where = f"checkpoint {self.directory}/{step}"
        _check_format(meta, where)
        wanted = describe(template, config, mesh, identity)
        check_match(_comparable({k: meta.get(k) for k in ("format", "config", "layout", "identity")}),
                    _comparable({k: wanted[k] for k in ("format", "config", "layout", "identity")}), where=where)
        moved = _moved_grids(meta.get("grids", {}), wanted["grids"])
        if moved and not regrid:
            _refuse_grids(meta.get("grids", {}), wanted["grids"], moved, where)
        template_values = {}
        if moved:
            keys = grid_leaf_keys(template, moved)
            template_values = {jax.tree_util.keystr(p): x for p, x in
                               jax.tree_util.tree_flatten_with_path(template)[0]
                               if jax.tree_util.keystr(p) in keys}
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
        want = {jax.tree_util.keystr(p) for p, _ in leaves}
        missing = sorted(want - set(meta["leaves"]) - set(template_values))
        unexpected = sorted(set(meta["leaves"]) - want)
        if missing or unexpected:
            raise CheckpointMismatch(
                f"{where} holds another state structure: missing "
                f"{missing[:3]}, unexpected {unexpected[:3]} (a different optimizer or model?)"
            )
        arrays = self.load_arrays(step)
        out = []
        for path, like in leaves:
            key = jax.tree_util.keystr(path)
            if key in template_values:  # a grid of this mesh's buckets, filled by regrid below
                out.append(template_values[key])
                continue
            host = arrays[key]
            if tuple(host.shape) != tuple(like.shape):
                raise CheckpointMismatch(f"{key}: the checkpoint holds shape {host.shape}, this state needs {like.shape}")
            if str(host.dtype) != str(like.dtype):
                raise CheckpointMismatch(f"{key}: the checkpoint holds {host.dtype}, this state needs {like.dtype}")
            out.append(_to_device(host, like.sharding))
        state = jax.tree_util.tree_unflatten(treedef, out)
        if moved:
            warnings.warn(f"{where}: the weight grids of {moved} have other buckets on this mesh; "
                          "their weights were re-projected onto it (round to nearest)", stacklevel=2)
            state = regrid_state(state, moved, config, mesh)
        return state, meta.get("extra", {})

    def load_arrays(self, step: int | None = None) -> dict[str, np.ndarray]:
        """The stored arrays ``{leaf path: numpy array}`` (zero-size ones included), e.g. to
        compare two runs' final states."""
        step = self._pick(step)
        meta = self.metadata(step)
        _check_format(meta, f"checkpoint {self.directory}/{step}")
        tree = self._manager.item_metadata(step)["arrays"]
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        got = self._manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.PyTreeRestore(
            item=tree, restore_args=as_numpy)))["arrays"]
        params = {".params" + jax.tree_util.keystr(p): np.asarray(x)
                  for p, x in jax.tree_util.tree_flatten_with_path(got["params"])[0]}
        state = got.get("state", {})
        out = {}
        for k, (shape, dtype) in meta["leaves"].items():
            if k in params:
                out[k] = params[k]
            elif int(np.prod(shape)) == 0:
                out[k] = np.zeros(shape, dtype)
            else:
                out[k] = np.asarray(state[meta["names"][k]])
        return out

    def wait(self) -> None:
        """Block until pending asynchronous saves are complete."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

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


def _to_device(host: np.ndarray, sharding) -> jax.Array:
    host = np.array(host, order="C", copy=True)  # (ascontiguousarray would make 0-d arrays 1-d)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
