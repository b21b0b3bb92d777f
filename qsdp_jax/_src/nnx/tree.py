"""What the Flax NNX front door reads from a module: its parameter groups, its layer stacks and
its non-parameter state.

* **Groups** (the unit of one gather): every top-level attribute of the module that holds
  parameters, and every entry of a top-level ``nnx.List`` / ``nnx.Dict`` (named ``"blocks/0"``,
  ``"layers/attn"``, ...). A group's parameters are its ``nnx.to_pure_dict`` nested dict.
* **Layer stacks** (the rule of :mod:`qsdp_jax._src.nnx.stacks`): a group is a stack of layers
  (as ``nnx.vmap`` + ``nnx.split_rngs`` make them) when it holds at least two parameters, every
  parameter has at least two dimensions and every variable in it (parameters, batch
  statistics, RNG keys and counts) shares one leading size, the layer count, and no flax layer
  in it (``nnx.Linear``, ``nnx.Embed``, the norms) holds a parameter of exactly its declared
  shape (an ``nnx.Embed`` table next to a position table of the same length is not a stack).
  An unstacked module almost always has a 1-D parameter (a bias, a norm scale) or parameters
  of different leading sizes; name the stacks yourself (``stacked=``) where the rule guesses
  wrong.
* **Nested stacks and lists**: inside a top-level group that is no stack, a sub-module that is
  a stack (with a flax layer showing the layer axis, or named in ``stacked=`` by its path, e.g.
  ``"trunk/layers"``) is a group of its own, and so is every entry of a nested ``nnx.List`` /
  ``nnx.Dict`` (``"trunk/layers/0"``, gathered for its own call as a top-level list's entries
  are); the top-level group keeps the rest. A variable belongs to the group with the longest
  path it starts with (:meth:`ModelDef.group_of`).
* **Model state**: every variable that is not an ``nnx.Param``, as a flat dict
  ``{"a/b/c": array}``: batch statistics and counters (updated by the step), RNG keys (kept as
  raw key data, so the state holds plain arrays) and RNG counts.
* **Checks**: :func:`state_mismatches` compares a train state with the module, variable by
  variable (path, shape, dtype); :func:`in_mode` / :func:`mode_differences` give the module in
  a step's train/eval mode (a clone: the module is left as it is) and what that mode changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from qsdp_jax._src.nnx.stacks import (
    CONTAINERS,
    declared_evidence,
    layer_count,
    nested_candidates,
    nested_entries,
    nested_stacks,
    node_at,
    under,
)

PyTree = Any
Path = tuple


def path_str(path: Path) -> str:
    """``("blocks", 0, "kernel") -> "blocks/0/kernel"``."""
    return "/".join(str(k) for k in path)


@dataclasses.dataclass(frozen=True)
class Group:
    """One parameter group of a module."""

    name: str
    path: Path  # where the group's sub-module (or parameter) sits in the module
    stacked: bool
    n_layers: int  # 0 if not stacked


@dataclasses.dataclass(frozen=True)
class VarSpec:
    """One variable of the module: where it is, its type and metadata, its shape."""

    path: Path
    type: type[nnx.Variable]
    metadata: dict
    shape: tuple
    dtype: Any
    key_impl: Any = None  # for RNG keys: the PRNG implementation

    def make(self, value) -> nnx.Variable:
        """A fresh variable of this kind holding ``value`` (created in the current trace)."""
        return self.type.from_metadata(value, dict(self.metadata))


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDef:
    """Everything static about a module that the sharded step needs (no arrays)."""

    graphdef: Any
    groups: tuple[Group, ...]
    params: tuple[VarSpec, ...]
    others: tuple[VarSpec, ...]  # non-parameter variables
    layer_defs: dict  # stacked group name -> (graphdef of one layer, {path: VarSpec} in it)

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"unknown parameter group {name!r}; groups are {[g.name for g in self.groups]}")

    @property
    def stacked(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups if g.stacked)

    def group_of(self, path: Path) -> Group | None:
        """The group holding the variable at ``path``: the longest group path it starts with
        (a stack nested in a group belongs to the stack)."""
        best = None
        for g in self.groups:
            if path[: len(g.path)] == g.path and (best is None or len(g.path) > len(best.path)):
                best = g
        return best


def key_impl(key):
    """``jax.random.key_impl`` of a key array, or of an abstract one (``nnx.eval_shape``'s
    ``ShapeDtypeStruct``, which ``key_impl`` refuses): read from a tracer of it."""
    if not isinstance(key, jax.ShapeDtypeStruct):
        return jax.random.key_impl(key)
    found: list = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), key)
    return found[0]


def _spec(path: Path, var: nnx.Variable) -> VarSpec:
    value = var.get_raw_value()
    impl = None
    if isinstance(var, nnx.RngKey):
        impl = key_impl(value)
    return VarSpec(
        tuple(path),
        type(var),
        dict(var.get_metadata()),
        tuple(jnp.shape(value)),
        jnp.result_type(value) if impl is None else None,
        impl,
    )


def describe(model: nnx.Module, stacked: Sequence[str] | None = None) -> ModelDef:
    """The :class:`ModelDef` of ``model`` (see the module docstring for the rules).

    Raises ``ValueError`` for a module without ``nnx.Param`` and for unknown ``stacked`` names.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"expected an nnx.Module, got {type(model).__name__}")
    # flax types split's result as (graphdef, state, *states); two filters give exactly three.
    graphdef, params, others = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    pspecs = tuple(_spec(p, v) for p, v in nnx.to_flat_state(params))
    ospecs = tuple(_spec(p, v) for p, v in nnx.to_flat_state(others))
    if not pspecs:
        raise ValueError(
            f"{type(model).__name__} has no nnx.Param: there is nothing to shard or train "
            "(parameters must be nnx.Param variables, e.g. those of nnx.Linear)"
        )
    top = _top_prefixes(model, pspecs)
    named = None if stacked is None else set(stacked)
    top_stacks = [t for t in top if _is_stack(model, pspecs, ospecs, t, named)]
    candidates = {path_str(c): c for c in nested_candidates(pspecs, [t for t in top if t not in top_stacks])}
    if named is not None:
        unknown = sorted(named - {path_str(t) for t in top} - set(candidates))
        if unknown:
            raise ValueError(
                f"stacked groups {unknown} are not groups or sub-modules of the module "
                f"(groups: {sorted(path_str(t) for t in top)})"
            )
    named_nested = None if named is None else {candidates[n] for n in named if n in candidates}
    unstacked_top = [t for t in top if t not in top_stacks]
    nested = nested_stacks(model, pspecs, ospecs, unstacked_top, named_nested)
    entries = nested_entries(model, pspecs, unstacked_top, nested)
    groups: list[Group] = []
    layer_defs: dict[str, tuple[Any, dict[Path, VarSpec]]] = {}
    for prefix in sorted(top + nested + entries, key=path_str):
        inner = [c for c in nested + entries if c != prefix and c[: len(prefix)] == prefix]
        p_in, o_in = under(pspecs, prefix, inner), under(ospecs, prefix, inner)
        if not p_in:  # every parameter of it sits in a nested stack
            continue
        is_stacked = prefix in nested or prefix in top_stacks
        n = layer_count(p_in, o_in, declared_evidence(node_at(model, prefix))) if not inner else None
        if is_stacked and n is None and named is not None:
            raise ValueError(
                f"group {path_str(prefix)!r} is named in stacked= but its variables do not share one "
                f"leading (layer) axis: shapes {[s.shape for s in p_in + o_in]}"
            )
        groups.append(Group(path_str(prefix), prefix, is_stacked, n if is_stacked and n is not None else 0))
        if is_stacked:
            layer_defs[path_str(prefix)] = _layer_def(node_at(model, prefix), prefix)
    return ModelDef(graphdef, tuple(groups), pspecs, ospecs, layer_defs)


def _top_prefixes(model, pspecs) -> list[Path]:
    """The top-level groups: attributes holding parameters, entries of top-level containers."""
    prefixes: list[Path] = []
    for spec in pspecs:
        head = spec.path[:1]
        container = getattr(model, str(head[0]), None) if not isinstance(head[0], int) else None
        if len(spec.path) > 1 and isinstance(container, CONTAINERS):
            head = spec.path[:2]
        if head not in prefixes:
            prefixes.append(head)
    return prefixes


def _is_stack(model, pspecs, ospecs, prefix: Path, named) -> bool:
    """A top-level group is a stack: named in ``stacked=``, or by the rule when none is given."""
    if named is not None:
        return path_str(prefix) in named
    p_in, o_in = under(pspecs, prefix), under(ospecs, prefix)
    return layer_count(p_in, o_in, declared_evidence(node_at(model, prefix))) is not None


submodule = node_at  # the node at a path (attributes, nnx.List / nnx.Dict entries)


def _layer_def(stack: nnx.Module, prefix: Path) -> tuple[Any, dict[Path, VarSpec]]:
    """(graphdef, {relative path: VarSpec of ONE layer}) of a layer stack."""
    graphdef, state = nnx.split(stack)
    specs: dict[Path, VarSpec] = {}
    for p, v in nnx.to_flat_state(state):
        s = _spec(p, v)
        specs[tuple(p)] = dataclasses.replace(s, shape=s.shape[1:])
    return graphdef, specs


# ----------------------------------------------------------------------------------------------
# Values: groups of parameters and the flat model state
# ----------------------------------------------------------------------------------------------
def group_params(model: nnx.Module, mdef: ModelDef) -> dict[str, PyTree]:
    """``{group name: nested pure dict of the group's parameters}`` (a bare parameter: the
    array itself): the parameter dict the low-level API (``init_train_state``) takes."""
    out: dict[str, PyTree] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        g = mdef.group_of(tuple(path))
        assert g is not None  # describe() made a group of every parameter's path prefix
        rel = tuple(path)[len(g.path) :]
        if not rel:  # a bare parameter
            out[g.name] = var.get_raw_value()
            continue
        node = out.setdefault(g.name, {})
        for k in rel[:-1]:
            node = node.setdefault(k, {})
        node[rel[-1]] = var.get_raw_value()
    return out


def model_state(model: nnx.Module, mdef: ModelDef) -> dict[str, jax.Array]:
    """The non-parameter variables as ``{"a/b": array}`` (RNG keys as raw key data)."""
    others = nnx.state(model, nnx.Not(nnx.Param))
    out = {}
    for p, v in nnx.to_flat_state(others):
        value = v.get_raw_value()
        if isinstance(v, nnx.RngKey):
            value = jax.random.key_data(value)
        out[path_str(p)] = jnp.asarray(value)
    return out


def set_params(model: nnx.Module, mdef: ModelDef, groups: dict[str, PyTree]) -> None:
    """Write group parameters (as from :func:`group_params`) into ``model`` in place."""
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        g = mdef.group_of(tuple(path))
        assert g is not None  # describe() made a group of every parameter's path prefix
        node = groups[g.name]
        for k in tuple(path)[len(g.path) :]:
            node = node[k]
        var.set_value(jnp.asarray(node, var.get_raw_value().dtype))
    nnx.update(model, state)


def set_model_state(model: nnx.Module, mdef: ModelDef, values: dict[str, jax.Array]) -> None:
    """Write a flat model state (as from :func:`model_state`) into ``model`` in place."""
    state = nnx.state(model, nnx.Not(nnx.Param))
    for path, var in nnx.to_flat_state(state):
        value = values[path_str(path)]
        if isinstance(var, nnx.RngKey):
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(var.get_raw_value()))
        var.set_value(value)
    nnx.update(model, state)


# ----------------------------------------------------------------------------------------------
# Checks: a train state against the module, the module's train/eval mode
# ----------------------------------------------------------------------------------------------
def state_mismatches(mdef: ModelDef, params: dict, values: dict | None) -> list[str]:
    """What in a train state's ``params`` (``{group: tree}``) and model state ``values`` does
    not fit the module of ``mdef``: missing or extra variables, other shapes or dtypes, as
    messages naming each variable by its module path. Works on tracers and abstract values."""
    have = {}
    for g in mdef.groups:
        for p, x in jax.tree_util.tree_flatten_with_path(params.get(g.name, {}))[0]:
            have["/".join([g.name] + [str(getattr(k, "key", k)) for k in p])] = (tuple(x.shape), x.dtype)
    want = {path_str(s.path): (s.shape, s.dtype) for s in mdef.params}
    out = _compare("nnx.Param", have, want)
    values = values or {}
    have = {k: (tuple(jnp.shape(x)), None) for k, x in values.items()}
    want = {path_str(s.path): (s.shape, None) for s in mdef.others}
    for s in mdef.others:  # RNG keys are held as key data: their shape is the impl's
        if s.key_impl is not None and path_str(s.path) in have:
            have[path_str(s.path)] = want[path_str(s.path)]
    return out + _compare("model state", have, want)


def _compare(kind: str, have: dict, want: dict) -> list[str]:
    """Messages for ``{path: (shape, dtype or None)}`` of the state against the module's."""
    out = [f"{kind} {k} of the module is not in the state" for k in sorted(set(want) - set(have))]
    out += [f"the state's {k} is no {kind} of the module" for k in sorted(set(have) - set(want))]
    for k in sorted(set(have) & set(want)):
        if _show(have[k]) != _show(want[k]):
            out.append(f"{kind} {k} is {_show(have[k])} in the state but {_show(want[k])} in the module")
    return out


def _show(shape_dtype) -> str:
    shape, dtype = shape_dtype
    return str(tuple(shape)) if dtype is None else f"{tuple(shape)} {jnp.dtype(dtype)}"


MODES = ("train", "eval", None)
_MODE_ATTRS = ("deterministic", "use_running_average")  # what Module.train() / eval() set


def in_mode(model: nnx.Module, mode: str | None) -> nnx.Module:
    """``model`` in ``mode``: for ``"train"`` / ``"eval"`` a clone (sharing the module's arrays)
    set as ``Module.train()`` / ``Module.eval()`` set it, the module itself untouched; for
    ``None`` the module as it is."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'train', 'eval' or None (the module's attributes as they are), got {mode!r}")
    if mode is None:
        return model
    graph = nnx.clone(model)
    # flax's own (not an override the module may define under the same name)
    nnx.Module.train(graph) if mode == "train" else nnx.Module.eval(graph)
    return graph


def mode_differences(model: nnx.Module, graph: nnx.Module) -> list[str]:
    """``"path attr=value"`` of the train/eval attributes (``deterministic``,
    ``use_running_average``) set to a boolean in ``model`` that ``graph`` sets otherwise."""
    mine = dict(_mode_attributes(model))
    out = []
    for key, value in _mode_attributes(graph):
        if isinstance(mine.get(key), bool) and mine[key] != value:
            out.append(f"{key[0] or '(the module)'} {key[1]}={mine[key]}")
    return out


def _mode_attributes(model):
    for path, m in nnx.iter_modules(model):
        for attr in _MODE_ATTRS:
            if hasattr(m, attr):
                yield (path_str(path), attr), getattr(m, attr)
