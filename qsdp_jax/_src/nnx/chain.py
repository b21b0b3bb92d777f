"""One compiled body for a chain of alike blocks: an ``nnx.List`` of blocks called in a Python loop
(``for block in self.blocks: x = block(x, ...)``) runs as one rematerialised ``lax.scan`` over
the blocks, with a ``lax.switch`` over the blocks' distinct graphs (a local and a global
attention layer differ in a static attribute, not in their parameters).

Unrolled, every block is its own copy of the forward, backward, gathers and reduce-scatters in
the compiled program, and compile time grows with the block count (Gemma 3 270M's 18 blocks:
most of the QSDP step's code). Scanned, the compiler sees one body per distinct graph.

**How a chain is found.** The step traces the loss twice: a first abstract trace
(``TrainStep._loss``, which already looks for groups read outside their call) records every
resharded call (:class:`Recorder`); :func:`find_chains` picks the runs of consecutive calls that
form a chain: each call's input at one position *is* the previous call's output (the same
array: nothing computed between the blocks), the call's other array inputs are the very arrays
the first call got, its other arguments are equal, each group is called once, its module holds
no model state, and the groups' layouts are alike (``sharded_access.layout_signature``). A chain
has at least two calls.

**How it runs.** In the step's trace the first call of a chain runs the whole chain
(``ShardedParams.chain``) and keeps every block's output; each later call checks it is given
the previous block's output and the same other inputs, and returns its block's output. Any
output may be used (kept for a skip connection, returned as aux): each is its block's own value.
Values and gradients are those of the unrolled calls (the same gathers, gradient keys and
arithmetic, up to XLA's fusion choices); ``make_train_step(scan_blocks=False)`` unrolls them.

Not chained (called one by one, as before): calls given a module, an ``nnx.Rngs`` or a variable
(plain calls, ``nnx_reshard``), blocks holding model state (batch statistics, RNG state),
blocks whose outputs are not one array shaped as their carried input, and anything the rule
above does not match.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax import lax

from qsdp_jax._src.nnx.active import params_untouched
from qsdp_jax._src.nnx.reshard import module_with
from qsdp_jax._src.nnx.stacks import node_at


@dataclasses.dataclass
class Call:
    """One resharded call seen by the first trace."""

    group: str
    flat: list  # the leaves of (args, kwargs)
    tree: Any
    out: Any
    signature: tuple  # sharded_access.layout_signature of the group
    stateless: bool


@dataclasses.dataclass(frozen=True)
class Chain:
    groups: tuple[str, ...]
    carry: int  # the position, among a call's (args, kwargs) leaves, of the carried input


class Recorder:
    """The resharded calls of the first trace, in order."""

    def __init__(self):
        self.calls: list[Call] = []

    def add(self, group, args, kwargs, out, signature, stateless: bool) -> None:
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        self.calls.append(Call(group, flat, tree, out, signature, stateless))


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _same(a, b) -> bool:
    """The same array object, or equal static values."""
    if _is_array(a) or _is_array(b):
        return a is b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an argument whose == is not a bool: not provably the same
        return False


def _link(prev: Call, nxt: Call, first: Call, carry: int | None) -> int | None:
    """The carried position if ``nxt`` continues the chain ``first`` .. ``prev``; else None."""
    if nxt.tree != first.tree or nxt.signature != first.signature or not nxt.stateless:
        return None
    if not isinstance(prev.out, jax.Array):
        return None
    hits = [i for i, x in enumerate(nxt.flat) if x is prev.out]
    if len(hits) != 1 or (carry is not None and hits[0] != carry):
        return None
    p = hits[0]
    src = first.flat[p]
    if not _is_array(src) or (src.shape, src.dtype) != (prev.out.shape, prev.out.dtype):
        return None
    if all(_same(a, b) for i, (a, b) in enumerate(zip(nxt.flat, first.flat)) if i != p):
        return p
    return None


def find_chains(calls: list[Call]) -> dict[str, tuple[Chain, int]]:
    """Group name -> (its chain, its position in it), for the chains among ``calls`` (module
    docstring)."""
    once = Counter(c.group for c in calls)
    out: dict[str, tuple[Chain, int]] = {}
    i = 0
    while i < len(calls):
        j, carry = i, None
        while j + 1 < len(calls) and calls[i].stateless and all(once[c.group] == 1 for c in calls[j : j + 2]):
            p = _link(calls[j], calls[j + 1], calls[i], carry)
            if p is None:
                break
            j, carry = j + 1, p
        if j > i and carry is not None:
            chain = Chain(tuple(c.group for c in calls[i : j + 1]), carry)
            out.update({g: (chain, k) for k, g in enumerate(chain.groups)})
        i = j + 1
    return out


class Runner:
    """The chains in the step's trace: the first call runs its chain, the others read it."""

    def __init__(self, chains: dict[str, tuple[Chain, int]]):
        self.chains = chains
        self._outs: dict[Chain, tuple[list, list]] = {}  # chain -> (first call's leaves, outputs)

    def __contains__(self, group: str) -> bool:
        return group in self.chains

    def call(self, ctx, group: str, args, kwargs):
        chain, pos = self.chains[group]
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        if pos == 0:
            self._outs[chain] = (flat, _run(ctx, chain, flat, tree))
        first, outs = self._outs.get(chain, (None, None))
        if first is None or outs is None or (pos and flat[chain.carry] is not outs[pos - 1]):
            raise RuntimeError(_DIFFERED.format(group=group))
        if any(not _same(a, b) for i, (a, b) in enumerate(zip(flat, first)) if i != chain.carry):
            raise RuntimeError(_DIFFERED.format(group=group))
        return outs[pos]


_DIFFERED = (
    "the loss called block {group!r} differently from its first trace (the step traces the loss "
    "twice and runs the blocks found chained in the first as one scan): make the loss's Python "
    "control flow the same on every trace, or pass scan_blocks=False to make_train_step"
)


def _run(ctx, chain: Chain, flat: list, tree) -> list:
    """Every block's output of ``chain``, from the first call's inputs ``flat``."""
    groups = [ctx.mdef.group(name) for name in chain.groups]
    branches: list = []
    graphs: list = []
    which: list[int] = []
    for g in groups:
        node = node_at(ctx.module, g.path)
        with params_untouched():  # the split reads every variable; the parameters come gathered
            graphdef, pstate, rstate = nnx.split(node, nnx.Param, ...)  # type: ignore[misc]
        k = next((i for i, other in enumerate(graphs) if other == graphdef), None)
        if k is None:
            k = len(graphs)
            graphs.append(graphdef)
            branches.append(_branch(graphdef, pstate, rstate, type(node).__mro__[1].__call__, flat, tree, chain.carry))
        which.append(k)
    for g in groups:
        ctx.record.setdefault(g.name, "per call")
    dyn = [x if _is_array(x) else None for x in flat]
    index = np.asarray(which, np.int32)

    def body(full, carry, i):
        if len(branches) == 1:
            return branches[0](full, carry, dyn)
        return lax.switch(jax.numpy.asarray(index)[i], branches, full, carry, dyn)

    return ctx.access.chain([g.name for g in groups], body, flat[chain.carry])


def _branch(graphdef, pstate, rstate, orig, flat: list, tree, carry: int):
    """One block's call as a function of its gathered weights, the carry and the array inputs."""

    def run(full, x, dyn):
        leaves = [d if d is not None else s for d, s in zip(dyn, flat)]
        leaves[carry] = x
        call_args, call_kwargs = jax.tree_util.tree_unflatten(tree, leaves)
        out = orig(module_with(graphdef, pstate, full, rstate), *call_args, **call_kwargs)
        return out.astype(x.dtype)

    return run
