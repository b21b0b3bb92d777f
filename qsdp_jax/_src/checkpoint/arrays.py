"""The ``arrays`` item of a checkpoint: how a state's leaves are stored in orbax and read back.

Two layouts (a plain orbax restore of ``arrays`` gives either as unsharded numpy arrays):

* a ``ParamAccess`` state: ``{"params": <the params dict>, "state": {leaf name: array}}``, the
  params pytree as it is and every other leaf (the step, the optimizer state) under a name
  ``leaf_0000``... that the record maps to the leaf's path (``meta["names"]``);
* an NNX state (:func:`stored_path`): every leaf nested as the module and ``nnx.Optimizer``
  nest them, ``{"params": {"trunk": {"layers": {"0": ...}}}, "opt_state": {"0": {"mu": {...}}},
  "step": ..., "qsdp": {"count": ..., "scales": {...}}, "model_state": {...}}``, so that a
  script without qsdp_jax puts the params into the module and the base optimizer's state into
  an ``nnx.Optimizer`` with ``nnx.replace_by_pure_dict``; the record maps each stored path back
  (``meta["stored_paths"]``; checkpoints before it stored only the params so,
  ``meta["module_paths"]``, and are read as they were).

Zero-size arrays (orbax refuses them) are not stored: the record's shape and dtype rebuild them.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_REPLICATE: dict = {}


def replicate(mesh: Mesh):
    """A jitted identity whose outputs are replicated on ``mesh`` (one cached per mesh)."""
    fn = _REPLICATE.get(mesh)
    if fn is None:
        _REPLICATE.clear()  # one mesh per process in practice; keep memory bounded
        fn = _REPLICATE[mesh] = jax.jit(lambda xs: xs, out_shardings=NamedSharding(mesh, P()))
    return fn


def is_param(key: str) -> bool:
    """A params leaf (stored in the ``arrays`` item's params pytree, not under ``state``)."""
    return key.startswith(".params")


def leaf_names(keys) -> dict[str, str]:
    """``{leaf path: stored name}`` of the leaves stored under ``state`` (every non-params one)."""
    return {k: f"leaf_{i:04d}" for i, k in enumerate(keys) if not is_param(k)}


def to_item(state, host: dict[str, np.ndarray], names: dict[str, str], by_module: bool = False) -> tuple[dict, dict]:
    """The ``arrays`` item of the host copies ``host`` of ``state``'s leaves (keyed as
    :func:`export_state` keys them) and ``{stored path: leaf path}`` (module docstring): with
    ``by_module`` (an NNX state) every non-empty leaf at its :func:`stored_path`; else the params
    pytree rebuilt of the host copies, the other non-empty leaves under their ``names``, and
    ``{}``.

    Raises:
      ValueError: two leaves of an NNX state would be stored at one path, or one inside another.
    """
    if not by_module:
        flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
        stored = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(state.params),
            [host[".params" + jax.tree_util.keystr(p)] for p, _ in flat],
        )
        rest = {names[k]: v for k, v in host.items() if k in names and v.size}
        return {"params": stored, "state": rest}, {}
    item: dict = {}
    where: dict[str, str] = {}
    for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        leaf, path = jax.tree_util.keystr(p), stored_path(p)
        if not host[leaf].size:
            continue
        node = item
        for i, k in enumerate(path[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"cannot store {leaf} at {'/'.join(path)}: {'/'.join(path[: i + 1])} is a leaf")
        if path[-1] in node:
            raise ValueError(f"cannot store {leaf} at {'/'.join(path)}: that path is taken")
        node[path[-1]] = host[leaf]
        where["/".join(path)] = leaf
    return item, where


def stored_path(key_path) -> tuple[str, ...]:
    """Where an NNX state's leaf is stored: its key path as strings, group names and model-state
    paths split at ``/`` (``.params['trunk/layers/0']['lin']['kernel']`` ->
    ``("params", "trunk", "layers", "0", "lin", "kernel")``); the base optimizer's state
    (``.opt_state.inner``) as ``"opt_state"``, as ``nnx.Optimizer`` keys it; QSDP's own optimizer
    fields (its count and the weight grids) under ``"qsdp"``."""
    keys = [k for entry in key_path for k in _key(entry).split("/")]
    if keys[:2] == ["opt_state", "inner"]:
        return ("opt_state", *keys[2:])
    if keys[0] == "opt_state" and len(keys) > 1 and keys[1] in ("count", "scales", "offsets"):
        return ("qsdp", *keys[1:])  # QSDPState's own fields
    return tuple(keys)


def from_item(got: dict, meta: dict) -> dict[str, np.ndarray]:
    """``{leaf path: numpy array}`` of every leaf the record ``meta`` lists, from the restored
    ``arrays`` item ``got`` (zero-size leaves rebuilt from their recorded shape and dtype; an NNX
    state's leaves mapped back through ``meta["stored_paths"]``, or its params through the older
    ``meta["module_paths"]``)."""
    back = meta.get("stored_paths") or meta.get("module_paths")  # None: a ParamAccess state
    tree = got if "stored_paths" in meta else got["params"]  # the older layout nested params only
    stored: dict[str, np.ndarray] = {}
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaf = ".params" + jax.tree_util.keystr(p) if back is None else back["/".join(map(_key, p))]
        stored[leaf] = np.asarray(x)
    state = got.get("state", {})
    out = {}
    for k, (shape, dtype) in meta["leaves"].items():
        if k in stored:
            out[k] = stored[k]
        elif int(np.prod(shape)) == 0:
            out[k] = np.zeros(shape, dtype)
        else:
            out[k] = np.asarray(state[meta["names"][k]])
    return out


def _key(k) -> str:
    """A key-path entry as a string (dict key, sequence index or attribute name)."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def export_state(state, mesh: Mesh) -> dict[str, jax.Array]:
    """Every leaf of ``state`` replicated on ``mesh``, keyed by its path (what
    :meth:`Checkpointer.save` stores).

    Args:
      state: a pytree of arrays, e.g. a :class:`~qsdp_jax.TrainState` (on ``mesh``).
      mesh: the mesh to replicate the leaves on.

    Returns:
      A dict ``{leaf path: array}`` from ``jax.tree_util.keystr`` of each leaf's path (e.g.
      ``".params['embed']['w']"``) to a global array replicated on every device of ``mesh``.
    """
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    out = replicate(mesh)([x for _, x in leaves])
    return {jax.tree_util.keystr(p): x for (p, _), x in zip(leaves, out)}
