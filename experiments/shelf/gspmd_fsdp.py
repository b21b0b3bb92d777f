"""The plain GSPMD FSDP train step a JAX user would write: the baseline row of the benchmarks.

No ``shard_map``, no explicit collectives: every parameter leaf is sharded over the 1-D mesh
axis ``"fsdp"`` on its largest dimension divisible by the device count (never the layer axis
of a stacked group; replicated if no dimension divides), the optax state is sharded like its
parameter, the batch on its leading axis, and ``jax.jit`` with ``in_shardings`` /
``out_shardings`` leaves the all-gathers and reduce-scatters to the XLA SPMD partitioner.

    mesh = qsdp_jax.make_mesh()                       # 1-D, axis "fsdp"
    model = GPT(GPTConfig.from_preset("tiny"))
    params, opt_state = init_state(model, mesh, jax.random.key(0))
    step = make_step(model, optax.adam(1e-3), mesh)
    params, opt_state, loss = step(params, opt_state, batch)
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from qsdp_jax.access import LocalParams

AXIS = "fsdp"
PyTree = Any


def leaf_spec(shape: tuple[int, ...], n: int, skip_leading: bool) -> P:
    """Where one leaf is sharded: its largest dimension divisible by ``n`` (the first such
    dimension on a tie).

    Args:
        shape: the leaf's shape.
        n: the number of devices on the ``"fsdp"`` axis.
        skip_leading: never shard dimension 0 (the layer axis of a stacked group).

    Returns:
        ``PartitionSpec`` with ``"fsdp"`` on the chosen dimension, or ``P()`` (replicated)
        when no candidate dimension is divisible by ``n``.
    """
    dims = [d for d in range(1 if skip_leading else 0, len(shape)) if shape[d] % n == 0]
    if not dims:
        return P()
    best = max(dims, key=lambda d: (shape[d], -d))
    return P(*(AXIS if d == best else None for d in range(len(shape))))


def _n_devices(mesh: Mesh) -> int:
    if AXIS not in mesh.shape:
        raise ValueError(f"the mesh needs an axis {AXIS!r}, it has {tuple(mesh.shape)}")
    return mesh.shape[AXIS]


def _stacked_flags(model, params: PyTree) -> PyTree:
    """A tree like ``params``: ``True`` on the leaves of the layer-stacked groups."""
    return {g: jax.tree.map(lambda _, s=g in model.stacked_groups: s, tree) for g, tree in params.items()}


def _shardings(model, optimizer, mesh: Mesh, params: PyTree) -> tuple[PyTree, PyTree]:
    """``NamedSharding`` trees of the parameters and of ``optimizer``'s state."""
    n = _n_devices(mesh)
    stacked = _stacked_flags(model, params)
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    param_sh = jax.tree.map(lambda a, s: named(leaf_spec(a.shape, n, s)), params, stacked)
    opt_abstract = jax.eval_shape(optimizer.init, params)
    # the rule by shape for each state leaf; a parameter-shaped one keeps its parameter's
    # stacked flag, any other (adam's step count) is treated as unstacked (a scalar: P())
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda a, s: named(leaf_spec(a.shape, n, s)),
        opt_abstract,
        stacked,
        transform_non_params=lambda a: named(leaf_spec(a.shape, n, False)),
    )
    return param_sh, opt_sh


def _default_optimizer(optimizer):
    return optax.adam(1e-3) if optimizer is None else optimizer


def abstract_state(model, mesh: Mesh, optimizer: optax.GradientTransformation | None = None) -> tuple[PyTree, PyTree]:
    """The sharded train state as ``ShapeDtypeStruct``s, allocating nothing.

    Args:
        model: an ``experiments.gpt.model.GPT`` (``abstract_params``, ``stacked_groups``).
        mesh: a mesh with the axis ``"fsdp"``.
        optimizer: the optax optimizer (default ``optax.adam(1e-3)``).

    Returns:
        ``(params, opt_state)``, each leaf a ``ShapeDtypeStruct`` carrying its sharding.
    """
    optimizer = _default_optimizer(optimizer)
    params = model.abstract_params()
    param_sh, opt_sh = _shardings(model, optimizer, mesh, params)
    with_sh = lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)  # noqa: E731
    return (
        jax.tree.map(with_sh, params, param_sh),
        jax.tree.map(with_sh, jax.eval_shape(optimizer.init, params), opt_sh),
    )


def init_state(model, mesh: Mesh, key, optimizer: optax.GradientTransformation | None = None) -> tuple[PyTree, PyTree]:
    """Fresh parameters and optimizer state, created already sharded (``jax.jit`` with
    ``out_shardings``, so no device ever holds the full model).

    Args:
        model: an ``experiments.gpt.model.GPT``.
        mesh: a mesh with the axis ``"fsdp"``.
        key: an int seed or a typed PRNG key, as ``model.init_params`` takes.
        optimizer: the optax optimizer (default ``optax.adam(1e-3)``).

    Returns:
        ``(params, opt_state)`` of sharded ``jax.Array``s.
    """
    optimizer = _default_optimizer(optimizer)
    param_sh, opt_sh = _shardings(model, optimizer, mesh, model.abstract_params())
    params = jax.jit(model.init_params, out_shardings=param_sh)(key)
    return params, jax.jit(optimizer.init, out_shardings=opt_sh)(params)


def make_step(model, optimizer: optax.GradientTransformation, mesh: Mesh):
    """The jitted GSPMD FSDP train step.

    Args:
        model: an ``experiments.gpt.model.GPT``; its loss reads the (GSPMD-sharded) parameters
            through ``LocalParams``.
        optimizer: the optax optimizer, run on the sharded gradients outside any shard_map.
        mesh: a mesh with the axis ``"fsdp"``.

    Returns:
        ``step(params, opt_state, batch) -> (params, opt_state, loss)``, where ``batch`` is
        ``{"inputs", "targets"}`` of int ``[B, L]`` with ``B`` divisible by the device count.
        Parameters and optimizer state are donated (updated in place).
    """
    param_sh, opt_sh = _shardings(model, optimizer, mesh, model.abstract_params())
    batch_sh = NamedSharding(mesh, P(AXIS))
    replicated = NamedSharding(mesh, P())

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: model.loss(LocalParams(p), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(
        step,
        in_shardings=(param_sh, opt_sh, batch_sh),
        out_shardings=(param_sh, opt_sh, replicated),
        donate_argnums=(0, 1),
    )
