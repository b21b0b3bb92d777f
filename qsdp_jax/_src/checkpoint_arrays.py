"""The ``arrays`` item of a checkpoint: how a state's leaves are stored in orbax and read back.

The item is ``{"params": <the params dict>, "state": {leaf name: array}}``: the params pytree as
it is (a plain orbax restore of ``arrays`` gives it as unsharded numpy arrays), every other leaf
of the state (the step, the optimizer state, the model state) under a name ``leaf_0000``...
that the checkpoint's record maps to the leaf's path (``meta["names"]``). Zero-size arrays
(orbax refuses them) are not stored: the record's shape and dtype rebuild them.
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


def to_item(params, host: dict[str, np.ndarray], names: dict[str, str], by_module: bool = False) -> tuple[dict, dict]:
    """The ``arrays`` item of host arrays ``{leaf path: array}``: ``params`` (the state's params
    pytree) rebuilt of the host copies, the other leaves under their ``names`` (zero-size ones
    left out); and ``{stored path: leaf path}`` of the params when ``by_module``, else ``{}``.

    ``by_module`` (an NNX state, whose groups are named by module path: ``"trunk/layers/0"``):
    the params are stored as the module's own nested dict (``{"trunk": {"layers": {"0": ...}}}``,
    what ``nnx.to_pure_dict`` gives, keys as strings), so that a plain orbax restore of the item
    goes into the module with ``nnx.replace_by_pure_dict`` (after ``nnx.restore_int_paths``).
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    where: dict[str, str] = {}
    if by_module:
        stored_params: dict = {}
        for p, _ in flat:
            keys = [*_key(p[0]).split("/"), *map(_key, p[1:])]
            node = stored_params
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = host[".params" + jax.tree_util.keystr(p)]
            where["/".join(keys)] = ".params" + jax.tree_util.keystr(p)
    else:
        stored_params = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(params), [host[".params" + jax.tree_util.keystr(p)] for p, _ in flat]
        )
    state = {names[k]: v for k, v in host.items() if k in names and v.size}
    return {"params": stored_params, "state": state}, where


def _key(k) -> str:
    """A key-path entry as a string (dict key, sequence index or attribute name)."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def from_item(got: dict, meta: dict) -> dict[str, np.ndarray]:
    """``{leaf path: numpy array}`` of every leaf the record ``meta`` lists, from the restored
    ``arrays`` item ``got`` (zero-size leaves rebuilt from their recorded shape and dtype; params
    stored by module path mapped back through ``meta["module_paths"]``)."""
    by_module = meta.get("module_paths")
    flat = jax.tree_util.tree_flatten_with_path(got["params"])[0]
    if by_module:
        params = {by_module["/".join(map(_key, p))]: np.asarray(x) for p, x in flat}
    else:
        params = {".params" + jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}
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
