"""Reshard after forward for NNX groups called as modules (PyTorch FSDP2's
``reshard_after_forward``).

A group that is a sub-module with its own ``__call__`` (a block of an ``nnx.List``, an attention
or MLP module held by the model) is gathered when it is called and freed when the call returns:
the call runs inside a ``jax.custom_vjp`` whose residuals are the group's *local blocks*, the
call's inputs and its model state, never the gathered weights. The backward pass gathers the
group again and re-runs the call (with the same inputs, state and gradient keys, so the same
values) to take its gradient. Peak memory then holds one or two groups' full weights, whatever
the number of blocks, as ``q.nnx.scan`` does for a layer stack.

The call's gathers and their data dependencies are :func:`qsdp_jax._src.collective.regather.regathered`'s.

Not resharded (gathered on first read and held to the backward, as before): stacks; groups
that hold a nested stack or share a sub-module with another group; groups the loss also reads
other than through their module's ``__call__`` (a tied embedding's ``attend``: found by a first,
abstract trace of the loss, ``qsdp_jax.nnx.TrainStep``), which resharding would gather twice
in the forward pass. Calls that run plain: a call given a module or a variable as an argument
(read inside the call, its weights would be gathered outside this custom_vjp), and a call
inside another transform (``nnx.remat``, ``nnx.vmap``; the transform reads the group's state,
which gathers it; a resharded call re-runs its forward in the backward pass already, so a
remat around it is redundant).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from qsdp_jax._src.nnx.active import current, non_params, params_untouched
from qsdp_jax._src.nnx.stacks import node_at

_CLASSES: dict[type, type] = {}


def resharding_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``__call__`` reshards (one per class, cached)."""
    sub = _CLASSES.get(cls)
    if sub is None:
        orig = cls.__call__

        def __call__(self, *args, **kwargs):
            ctx = current()
            group = None if ctx is None else ctx.reshard_group(self)
            if group is None or _holds_graph_nodes((args, kwargs)):
                return orig(self, *args, **kwargs)  # a plain call (see the module docstring)
            return call_resharded(ctx, group, self, orig, args, kwargs)

        sub = type(cls)(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
        sub.__qualname__ = cls.__qualname__
        _CLASSES[cls] = sub
    return sub


def can_reshard(node, group, mdef) -> bool:
    """A group is resharded when it is a module with its own ``__call__`` whose parameters are
    exactly the group's: no other group nested in it, none shared into it."""
    if group.stacked or not isinstance(node, nnx.Module):
        return False
    if not any("__call__" in vars(c) for c in type(node).__mro__[:-1]):
        return False
    with params_untouched():
        paths = {tuple(p) for p, _ in nnx.to_flat_state(nnx.state(node, nnx.Param))}
    own = {s.path[len(group.path) :] for s in mdef.params if mdef.group_of(s.path) is group}
    return paths == own


def can_reshard_any(model, mdef) -> bool:
    """Whether any group of ``model`` (described by ``mdef``) would be resharded: without one,
    the step needs no first trace to find the groups read outside their call."""
    return any(can_reshard(node_at(model, g.path), g, mdef) for g in mdef.groups)


def _holds_graph_nodes(tree) -> bool:
    """Whether a call's arguments hold NNX modules or variables (read inside the call, their
    weights would be another group's, gathered outside this one's custom_vjp)."""
    graph = lambda x: isinstance(x, (nnx.Module, nnx.Variable))  # noqa: E731
    return any(graph(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=graph))


def call_resharded(ctx, group, module, orig, args: tuple, kwargs: dict) -> Any:
    """``orig(module, *args, **kwargs)`` with ``group``'s weights gathered for the call and
    gathered again in its backward pass (see the module docstring); a call of a chain of alike
    blocks reads the chain's one scan (``qsdp_jax._src.nnx.chain``)."""
    if ctx.chains is not None and group.name in ctx.chains:
        return ctx.chains.call(ctx, group.name, args, kwargs)
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(flat) if isinstance(x, (jax.Array, np.ndarray))]
    with params_untouched():  # the split reads every variable; the parameters come gathered
        graphdef, pstate, rstate = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
    rpaths = [p for p, _ in nnx.to_flat_state(rstate)]

    def run(full, dyn, state):
        leaves = list(flat)
        for i, x in zip(where, dyn):
            leaves[i] = x
        call_args, call_kwargs = jax.tree_util.tree_unflatten(tree, leaves)
        copy = module_with(graphdef, pstate, full, _state(rstate, list(zip(rpaths, state))))
        out = orig(copy, *call_args, **call_kwargs)
        return out, [v.get_raw_value() for _, v in non_params(copy)]

    ctx.record.setdefault(group.name, "per call")
    state = [v.get_raw_value() for _, v in nnx.to_flat_state(rstate)]
    # the call's own inputs first: the next call's gather is tied to the first of them
    out, new = ctx.access.call(group.name, run, [flat[i] for i in where], state)
    nnx.update(module, _state(rstate, list(zip(rpaths, new))))
    if ctx.recorder is not None:  # the first trace: which calls chain (nnx_chain)
        ctx.recorder.add(group.name, args, kwargs, out, ctx.access.signature(group.name), not rpaths)
    return out


def module_with(graphdef, pstate, full, rstate) -> nnx.Module:
    """A copy of a module, made in this trace (NNX updates variables only in their own trace):
    ``graphdef`` holding the gathered weights ``full`` (a tree by the parameters' paths) in
    ``pstate``'s variables, and the model state ``rstate``."""
    params = _state(pstate, [(p, _at(full, p)) for p, _ in nnx.to_flat_state(pstate)])
    return nnx.merge(graphdef, params, rstate)


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _state(template, items):
    """A state of ``template``'s variables (same types and metadata) holding ``items``' values."""
    variables = dict(nnx.to_flat_state(template))
    return nnx.from_flat_state([(p, variables[p].replace(value)) for p, value in items])
