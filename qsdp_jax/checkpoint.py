"""Checkpoints of the sharded train state on orbax: exact resume, and resharding on restore.

Usage::

    ckpt = qsdp_jax.Checkpointer("runs/x/ckpt", keep=3)
    ckpt.save(state, config, mesh, extra={"data_position": int(state.step)})   # asynchronous
    ...
    template = qsdp_jax.init_train_state(params, opt, mesh, config, stacked=...)  # any mesh
    state, extra = ckpt.restore(template, config, mesh)          # latest complete checkpoint

**What is stored.** Every array leaf of the :class:`~qsdp_jax.train.TrainState` (whatever its
fields: the state is walked generically), in a form that does not depend on the device count:

* a flat parameter buffer ``params["sharded"][group]`` is cut to its *bucketed* length (the
  leaves padded to whole buckets; the padding that makes every device hold the same whole
  buckets is dropped: it is zeros);
* an optimizer-state leaf (leading device axis) that lives under ``["sharded"][group]`` (Adam's
  moments, QSDP's per-bucket scales and offsets...) is concatenated over devices in global order
  and cut the same way (to the bucketed length, or the bucketed number of buckets); any other
  optimizer-state leaf (counts, moments of replicated leaves) is the same on every device and
  is stored once;
* zero-size arrays (orbax refuses them) are stored as their shape and dtype only;
* beside the arrays, a JSON record of what defines the checkpoint: the QSDPConfig, the layout
  (groups, leaves, shapes, dtypes, offsets), every leaf's shape, the mesh shape, the library
  version, the step and the caller's ``identity`` (what must match, e.g. the run's settings)
  and ``extra`` (what is carried, e.g. the data position).

On restore the arrays are re-laid out for the template's mesh (padding with zeros, which is what
a fresh state holds there: a constant bucket has scale 0 and offset 0), so a checkpoint made on
8 devices loads on 4, on a hierarchical ``("node", "local")`` 2x4 mesh or a hybrid
``("replica", "fsdp")`` one (and back) with weights, grid and optimizer state bit for bit: the
config's mesh-placement fields (``axis_name``, ``node_axis``, ``replica_axis``) are not compared. Bucket ids are global,
so the grid does not move. A config, layout, leaf or identity mismatch is refused with an error
naming the field.

**Atomic.** Orbax writes a step into a temporary directory and renames it when complete; only
complete steps are listed, so a checkpoint half-written when the process died is never picked up
(and its leftovers are removed when the next manager opens the directory).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from qsdp_jax import policy
from qsdp_jax.config import QSDPConfig
from qsdp_jax.sharding import FlatLayout

FORMAT = 1
PyTree = Any


class CheckpointMismatch(ValueError):
    """The checkpoint was made for another config, model or run; the message names the field."""


def library_version() -> str:
    try:
        return importlib.metadata.version("qsdp_jax")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source checkout
        return "unknown"


# ----------------------------------------------------------------------------------------------
# Leaf classification and the device-count-independent form
# ----------------------------------------------------------------------------------------------
def _bucketed(g) -> int:
    """End of a group's last leaf in its flat buffer (round up to whole buckets for the length)."""
    return max((s.offset + s.size for s in g.slots), default=0)


def _kind(path, layout: FlatLayout) -> tuple[str, str | None]:
    """``("flat", key)``, ``("opt_sharded", key)``, ``("opt_rep", None)`` or ``("plain", None)``
    (``key``: the flat buffer's key, its group's name without a bit policy)."""
    head = path[0].name if isinstance(path[0], jax.tree_util.GetAttrKey) else None
    group = None
    for a, b in zip(path, path[1:]):
        if isinstance(a, jax.tree_util.DictKey) and a.key == "sharded" and isinstance(b, jax.tree_util.DictKey):
            group = b.key
            break
    if head == "params" and group is not None:
        return "flat", group
    if head == "opt_state":
        return ("opt_sharded", group) if group is not None else ("opt_rep", None)
    return "plain", None


def _real_length(total: int, g, bucket: int, where: str) -> int:
    """The device-independent length of a sharded leaf's global last axis ``total``."""
    real = -(-_bucketed(g) // bucket) * bucket
    if total == 0:  # a zero-size placeholder (e.g. no grid in full-precision modes)
        return 0
    if total == g.flat_size:
        return real
    if total * bucket == g.flat_size:
        return real // bucket
    raise ValueError(
        f"{where}: a leaf under ['sharded'][{g.name!r}] has global length {total}, neither the "
        f"buffer's {g.flat_size} nor its {g.flat_size // bucket} buckets; cannot store it "
        "independently of the device count"
    )


def _export_leaf(x, path, layout: FlatLayout):
    kind, group = _kind(path, layout)
    where = jax.tree_util.keystr(path)
    if kind == "flat":
        g = layout.buffer(group)
        return x[..., : _real_length(x.shape[-1], g, layout.bucket, where)]
    if kind == "opt_sharded":
        g = layout.buffer(group)
        full = jnp.moveaxis(x, 0, -2).reshape(*x.shape[1:-1], x.shape[0] * x.shape[-1])
        return full[..., : _real_length(full.shape[-1], g, layout.bucket, where)]
    if kind == "opt_rep":
        return x[0]
    return x


def _import_leaf(saved: np.ndarray, like, path, layout: FlatLayout) -> np.ndarray:
    """The array of shape ``like.shape`` for this mesh from the stored form (numpy, on host).
    The device count is the template's leading optimizer-state axis (whatever the mesh's
    shape)."""
    kind, group = _kind(path, layout)
    n = like.shape[0] if kind in ("opt_sharded", "opt_rep") else 1
    where = jax.tree_util.keystr(path)
    if kind in ("flat", "opt_sharded"):
        total = like.shape[-1] * (n if kind == "opt_sharded" else 1)
        lead = like.shape[1:-1] if kind == "opt_sharded" else like.shape[:-1]
        real = _real_length(total, layout.buffer(group), layout.bucket, where)
        if saved.shape != (*lead, real):
            raise CheckpointMismatch(f"{where}: the checkpoint holds shape {saved.shape}, this state needs {(*lead, real)}")
        full = np.zeros((*lead, total), saved.dtype)
        full[..., :real] = saved
        if kind == "flat":
            return full
        return np.moveaxis(full.reshape(*lead, n, total // n), -2, 0)
    if kind == "opt_rep":
        if saved.shape != tuple(like.shape[1:]):
            raise CheckpointMismatch(f"{where}: the checkpoint holds shape {saved.shape}, this state needs {like.shape[1:]}")
        return np.broadcast_to(saved, like.shape)
    if saved.shape != tuple(like.shape):
        raise CheckpointMismatch(f"{where}: the checkpoint holds shape {saved.shape}, this state needs {like.shape}")
    return saved


_EXPORT_CACHE: dict = {}


def export_state(state, mesh: Mesh) -> dict[str, jax.Array]:
    """``{path: array}`` of every leaf of ``state`` in the device-count-independent form
    (replicated arrays on ``mesh``)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    paths = tuple(p for p, _ in leaves)
    key = (treedef, paths, mesh, tuple((x.shape, str(x.dtype)) for _, x in leaves))
    fn = _EXPORT_CACHE.get(key)
    if fn is None:
        layout = state.layout

        def export(xs):
            return [_export_leaf(x, p, layout) for p, x in zip(paths, xs)]

        fn = jax.jit(export, out_shardings=NamedSharding(mesh, P()))
        _EXPORT_CACHE.clear()  # one layout per process in practice; keep memory bounded
        _EXPORT_CACHE[key] = fn
    out = fn([x for _, x in leaves])
    return {jax.tree_util.keystr(p): x for p, x in zip(paths, out)}


# ----------------------------------------------------------------------------------------------
# What defines a checkpoint
# ----------------------------------------------------------------------------------------------
def describe_layout(layout: FlatLayout) -> dict:
    """The device-count-independent part of a layout (the model's shape as the state sees it)."""
    return {
        "bucket": layout.bucket,
        "groups": {
            g.name: {
                "stacked": g.stacked,
                "n_layers": g.n_layers,
                "treedef": str(g.treedef),
                "num_leaves": g.num_leaves,
                "slots": [[s.index, list(s.shape), s.dtype, s.offset, s.size] for s in g.slots],
                "replicated": list(g.replicated),
                **policy.describe_buffers(g),
            }
            for g in layout.groups
        },
    }


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
            names={k: f"leaf_{i:04d}" for i, k in enumerate(arrays)},
        )
        # Host copies now (each process holds the full replicated array): the caller may donate
        # or delete the state as soon as this returns; the files are written in the background.
        stored = {meta["names"][k]: np.asarray(v.addressable_data(0)) for k, v in arrays.items() if v.size > 0}
        return bool(self._manager.save(
            step, args=ocp.args.Composite(arrays=ocp.args.PyTreeSave(stored), meta=ocp.args.JsonSave(meta)),
            force=force,
        ))

    def restore(self, template, config: QSDPConfig, mesh: Mesh, *, step: int | None = None,
                identity: dict | None = None):
        """``(state, extra)`` from a checkpoint (default: the latest complete one), laid out
        like ``template`` (a TrainState, concrete or abstract, for this mesh and config).

        Raises :class:`CheckpointMismatch` naming the field when the config, layout, leaves or
        ``identity`` differ, and ``FileNotFoundError`` when there is no checkpoint.
        """
        self.wait()
        step = self._pick(step)
        meta = self.metadata(step)
        check_match(_comparable({k: meta.get(k) for k in ("format", "config", "layout", "identity")}),
                    _comparable(describe(template, config, mesh, identity)),
                    where=f"checkpoint {self.directory}/{step}")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
        want = {jax.tree_util.keystr(p) for p, _ in leaves}
        missing, unexpected = sorted(want - set(meta["leaves"])), sorted(set(meta["leaves"]) - want)
        if missing or unexpected:
            raise CheckpointMismatch(
                f"checkpoint {self.directory}/{step} holds another state structure: missing "
                f"{missing[:3]}, unexpected {unexpected[:3]} (a different optimizer or model?)"
            )
        arrays = self.load_arrays(step)
        out = []
        for path, like in leaves:
            host = _import_leaf(arrays[jax.tree_util.keystr(path)], like, path, template.layout)
            if str(host.dtype) != str(like.dtype):
                key = jax.tree_util.keystr(path)
                raise CheckpointMismatch(f"{key}: the checkpoint holds {host.dtype}, this state needs {like.dtype}")
            out.append(_to_device(host, like.sharding))
        return jax.tree_util.tree_unflatten(treedef, out), meta.get("extra", {})

    def load_arrays(self, step: int | None = None) -> dict[str, np.ndarray]:
        """The stored device-count-independent arrays ``{leaf path: array}`` (zero-size ones
        included), e.g. to compare two runs' final states."""
        step = self._pick(step)
        meta = self.metadata(step)
        names = meta["names"]
        stored = [names[k] for k, (shape, _) in meta["leaves"].items() if int(np.prod(shape)) > 0]
        got = self._manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.PyTreeRestore(
            restore_args={n: ocp.RestoreArgs(restore_type=np.ndarray) for n in stored})))["arrays"]
        return {k: np.asarray(got[names[k]]) if int(np.prod(shape)) > 0 else np.zeros(shape, dtype)
                for k, (shape, dtype) in meta["leaves"].items()}

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
