"""The module inside the sharded step, and ``scan``: the ``nnx.scan`` drop-in.

Inside the step (``qsdp_jax.nnx.make_train_step``) the loss receives a module merged from the
model's cached ``GraphDef`` in which

* every ``nnx.Param`` is a :class:`ShardedParam`: reading it (``param[...]``, ``get_value``,
  a split by an NNX transform) gathers its whole *group* once per trace level, the first time
  any parameter of the group is read (``ParamAccess.gather``), so the gathers sit where the
  forward first needs each group;
* the non-parameter variables hold the carried model state; RNG keys are folded with the step
  and the device index, so every stream is a pure function of (seed, step, device);
* every ``nnx.BatchNorm`` without an ``axis_name`` gets the mesh axis (synchronised batch
  norm), so its statistics, like every gradient, are those of the global batch.

:func:`scan` is exactly ``nnx.scan`` outside the step. Inside it, given a layer stack of the
module, it runs the same function one layer at a time through ``ParamAccess.scan``: each layer's
weights are gathered inside a rematerialised ``lax.scan`` body (and re-gathered in the backward
pass), so peak memory holds one layer. Reading a stack any other way gathers all its layers
at once; the step's ``summary`` says what that costs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from qsdp_jax._src.nnx import take as nnx_take
from qsdp_jax._src.nnx.annotations import ignore_out_sharding
from qsdp_jax._src.nnx.active import _ACTIVE, current, non_params, params_untouched
from qsdp_jax._src.nnx.reshard import can_reshard, resharding_class
from qsdp_jax._src.nnx.tree import Group, ModelDef, path_str, submodule


def _current_trace():
    return jax.extend.core.get_opaque_trace_state(convention="nnx")


class ShardedParam(nnx.Param):
    """An ``nnx.Param`` whose value is gathered on read inside the sharded step."""

    __slots__ = ("_qsdp_read",)

    def _refresh(self):
        read = getattr(self, "_qsdp_read", None)
        if read is not None and not getattr(_ACTIVE, "untouched", False):
            object.__setattr__(self, "_raw_value", read())

    def get_value(self, **kwargs):
        self._refresh()
        return super().get_value(**kwargs)

    # flax marks get_raw_value final (typing only, not enforced); the lazy gather must hook it,
    # since flax's own code reads parameters through it.
    def get_raw_value(self):  # type: ignore[misc]
        self._refresh()
        return super().get_raw_value()


class StepContext:
    """What the module and :func:`scan` see while the sharded loss is traced."""

    def __init__(
        self,
        access,
        mdef: ModelDef,
        axis: str | tuple[str, ...],
        record: dict,
        reshard=False,
        held=frozenset(),
        take=False,
        recorder=None,
        chains=None,
    ):
        self.access = access  # qsdp_jax.train.ShardedParams
        self.mdef = mdef
        self.axis = axis
        self.record = record  # group name -> "whole" / "per layer" / "per call" / "rows", for the summary
        self.reshard = reshard  # groups called as modules are gathered per call (nnx_reshard)
        self.held = held  # groups not resharded (read outside their call too)
        self.take = take  # nnx.Embed lookups read rows (nnx_take)
        self.recorder = recorder  # nnx_chain.Recorder: the first trace records its calls
        self.chains = chains  # nnx_chain.Runner: the chains of alike blocks, run as one scan
        self.module: nnx.Module | None = None  # built for this trace (build)
        self.taken: dict[int, tuple[str, str]] = {}  # id(embed) -> (group, leaf path)
        self.stacks: dict[int, Group] = {}
        self.resharded: dict[int, Group] = {}
        self.base_trace = None  # the loss's own trace level
        self._cache: list = []  # (group name, trace, value)

    # --- reading parameters -------------------------------------------------------------------
    def load(self, group: Group):
        """The gathered parameters of ``group``: once per group and trace level."""
        trace = _current_trace()
        for name, t, value in self._cache:
            if name == group.name and t == trace:
                return value
        if trace == self.base_trace and group.name in self.record:
            self.record[group.name] = "whole"  # read outside its call too: held to the backward
        if group.stacked:
            self.record[group.name] = "whole"
            _, value = self.access.scan(group.name, lambda c, layer, _: (c, layer), None, remat=False)
        else:
            self.record.setdefault(group.name, "whole")
            value = self.access.gather(group.name)
        self._cache.append((group.name, trace, value))
        return value

    def read(self, group: Group, rel: tuple):
        node = self.load(group)
        for k in rel:
            node = node[k]
        return node

    # --- the module -----------------------------------------------------------------------------
    def build(self, values: dict, step) -> nnx.Module:
        """The module for this trace: lazy parameters, the carried state, folded RNG keys."""
        params = []
        for spec in self.mdef.params:
            g = self.mdef.group_of(spec.path)
            assert g is not None  # describe() made a group of every parameter's path prefix
            var = ShardedParam.from_metadata(jax.ShapeDtypeStruct(spec.shape, spec.dtype), dict(spec.metadata))
            object.__setattr__(var, "_qsdp_read", functools.partial(self.read, g, spec.path[len(g.path) :]))
            params.append((spec.path, var))
        device = lax.axis_index(self.axis)
        others = []
        for spec in self.mdef.others:
            value = values[path_str(spec.path)]
            if issubclass(spec.type, nnx.RngKey):
                value = fold_keys(jax.random.wrap_key_data(value, impl=spec.key_impl), step, device)
            others.append((spec.path, spec.make(value)))
        module = nnx.merge(self.mdef.graphdef, nnx.from_flat_state(params), nnx.from_flat_state(others))
        self.module = module
        sync_batch_norm(module, self.axis)
        self.base_trace = _current_trace()
        if self.take:
            self.taken = nnx_take.install(module, self.mdef)
        # after take's classes (their calls take out_sharding too), before resharding's
        ignore_out_sharding(module)  # the step lays arrays out itself (nnx_annotations)
        for g in self.mdef.groups:
            node = submodule(module, g.path)
            if g.stacked:
                self.stacks[id(node)] = g
            elif self.take and nnx_take.only_tables(g.name, self.mdef, self.taken):
                continue  # its calls read rows: nothing to gather for them
            elif self.reshard and g.name not in self.held and can_reshard(node, g, self.mdef):
                object.__setattr__(node, "__class__", resharding_class(type(node)))
                self.resharded[id(node)] = g
        return module

    def at_base_level(self) -> bool:
        """Tracing at the loss's own level (not inside a transform or a resharded call)."""
        return _current_trace() == self.base_trace

    def reshard_group(self, module) -> Group | None:
        """The group a call of ``module`` reshards: a resharded group's module called at the
        loss's own level, its weights not read there yet; else None (a plain call)."""
        g = self.resharded.get(id(module))
        if g is None or _current_trace() != self.base_trace:
            return None
        if any(name == g.name and t == self.base_trace for name, t, _ in self._cache):
            return None
        return g

    def read_state(self, module: nnx.Module, values: dict) -> dict:
        """The model state after the loss: batch statistics averaged over the devices, RNG
        state as it came in (the streams advance with the step), other variables as computed."""
        out = {}
        for path, var in non_params(module):
            key = path_str(path)
            if isinstance(var, nnx.RngState):
                out[key] = values[key]
                continue
            value = var.get_value()
            if isinstance(var, nnx.BatchStat) and jnp.issubdtype(jnp.result_type(value), jnp.floating):
                value = lax.pmean(value, self.axis)
            out[key] = value
        return out

    @contextlib.contextmanager
    def active(self):
        stack = getattr(_ACTIVE, "stack", [])
        _ACTIVE.stack = stack + [self]
        try:
            yield self
        finally:
            _ACTIVE.stack = stack


def sync_batch_norm(module: nnx.Module, axis: str | tuple[str, ...]) -> None:
    """Give every ``nnx.BatchNorm`` without an ``axis_name`` the mesh axis: its statistics are
    then those of the global batch (the step computes what one device would on that batch)."""
    for _, m in nnx.iter_modules(module):
        if isinstance(m, nnx.BatchNorm) and m.axis_name is None:
            # flax types axis_name as str | None, but its lax.pmean takes a tuple of axes too
            # (a 2-D mesh's batch axes)
            m.axis_name = axis  # type: ignore[assignment]


def fold_keys(keys: jax.Array, step, device) -> jax.Array:
    """``fold_in(fold_in(key, step), device)`` for every key of a key array of any shape."""
    fold = lambda k: jax.random.fold_in(jax.random.fold_in(k, step), device)  # noqa: E731
    flat = keys.reshape(-1)
    return jax.vmap(fold)(flat).reshape(keys.shape)


# ----------------------------------------------------------------------------------------------
# The nnx.scan drop-in
# ----------------------------------------------------------------------------------------------
_MISSING = object()


def scan(
    f: Callable | Any = _MISSING,
    *,
    length=None,
    reverse=False,
    unroll=1,
    in_axes=(nnx.Carry, 0),
    out_axes=(nnx.Carry, 0),
    **kwargs,
):
    """``nnx.scan`` with per-layer gathers inside the QSDP step; the same call forms.

    Use it as a decorator (``@qsdp_jax.nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)``)
    or call it (``qsdp_jax.nnx.scan(f, in_axes=..., out_axes=...)(x, self.blocks)``). Outside
    the sharded step it *is* ``nnx.scan``. Inside it, the argument scanned on axis 0 that is a
    layer stack of the model is read one layer at a time (``ParamAccess.scan``, rematerialised);
    ``in_axes`` entries may be ``nnx.Carry`` (exactly one), ``0`` or ``None``; ``out_axes`` is
    ``nnx.Carry`` or a tuple of ``nnx.Carry`` (once) and ``0``.

    Args:
        f: The scanned function, ``f(carry, layer, ...) -> carry`` (or ``(carry, ys)``). Omit it
            to use ``scan`` as a decorator factory.
        length: The number of iterations, as for ``nnx.scan`` (inside the step it must equal the
            stack's number of layers).
        reverse: Scan from the last layer to the first (``nnx.scan`` only: refused inside the step).
        unroll: Passed to ``nnx.scan`` / ``lax.scan``.
        in_axes: Per argument: ``nnx.Carry`` (exactly one), ``0`` (scanned: a layer stack is read
            one layer at a time) or ``None`` (broadcast).
        out_axes: ``nnx.Carry``, or a tuple of ``nnx.Carry`` (once) and ``0``.
        **kwargs: Further ``nnx.scan`` options, used outside the step.

    Returns:
        The wrapped function (called with the same arguments as ``f``), or, when ``f`` is
        omitted, a decorator that makes it.

    Raises:
        ValueError: A module scanned on axis 0 is not a layer stack (its variables do not share
            one leading size), or ``length`` does not match the stack.
        NotImplementedError: ``in_axes``/``out_axes`` forms or ``reverse`` that the sharded step
            does not support.
    """
    if f is _MISSING:
        return lambda g: scan(
            g, length=length, reverse=reverse, unroll=unroll, in_axes=in_axes, out_axes=out_axes, **kwargs
        )
    plain = nnx.scan(f, length=length, reverse=reverse, unroll=unroll, in_axes=in_axes, out_axes=out_axes, **kwargs)

    @functools.wraps(f)
    def wrapper(*args):
        axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
        ctx = current()
        registered = [i for i, a in enumerate(axes) if a == 0 and ctx is not None and id(args[i]) in ctx.stacks]
        _check_stacks(args, axes, skip=registered)
        if not registered:
            return plain(*args)  # outside the step, or no stack of the model: nnx.scan
        assert ctx is not None  # registered is empty outside the step
        return _sharded_scan(ctx, f, args, axes, out_axes, registered, length, reverse)

    return wrapper


def _check_stacks(args, axes, skip):
    """A module scanned on axis 0 must be a layer stack: every variable with one leading size."""
    for i, (a, x) in enumerate(zip(axes, args)):
        if i in skip or a != 0 or not isinstance(x, nnx.Module):
            continue
        shapes = [jnp.shape(v.get_raw_value()) for _, v in nnx.to_flat_state(nnx.state(x))]
        leading = {s[0] if s else None for s in shapes}
        if not shapes or None in leading or len(leading) != 1:
            raise ValueError(
                f"scan: argument {i} ({type(x).__name__}) is scanned over axis 0 but is not a "
                f"layer stack (its variables' shapes {sorted(set(shapes))} share no leading "
                "layer axis); make the stack with nnx.split_rngs + nnx.vmap, or pass it with "
                "in_axes None"
            )


def _sharded_scan(ctx: StepContext, f, args, axes, out_axes, registered, length, reverse):
    carry_at = [i for i, a in enumerate(axes) if a is nnx.Carry]
    bad = [a for a in axes if a is not nnx.Carry and a not in (0, None)]
    if len(registered) != 1 or len(carry_at) != 1 or bad or reverse:
        raise NotImplementedError(
            "inside the QSDP step, qsdp_jax.nnx.scan supports exactly one layer stack and one "
            f"nnx.Carry argument, in_axes entries nnx.Carry / 0 / None and reverse=False; got "
            f"in_axes={axes}, {len(registered)} stack(s), reverse={reverse}"
        )
    mi, ci = registered[0], carry_at[0]
    group = ctx.stacks[id(args[mi])]
    if length is not None and length != group.n_layers:
        raise ValueError(f"scan: length={length} but the stack {group.name!r} has {group.n_layers} layers")
    xs_at = [i for i, a in enumerate(axes) if a == 0 and i != mi]
    stack = args[mi]
    layer_gd, layer_specs = ctx.mdef.layer_defs[group.name]
    rest = _values(stack)

    def body(carry, layer_params, x):
        xs, rest_l = x
        items = []
        for rel, spec in layer_specs.items():
            if issubclass(spec.type, nnx.Param):
                value = layer_params
                for k in rel:
                    value = value[k]
            else:
                value = rest_l[path_str(rel)]
            items.append((rel, spec.make(value)))
        layer = nnx.merge(layer_gd, nnx.from_flat_state(items))
        sync_batch_norm(layer, ctx.axis)
        call = list(args)
        call[ci], call[mi] = carry, layer
        for j, i in enumerate(xs_at):
            call[i] = xs[j]
        new_carry, ys = _split_out(f(*call), out_axes)
        new_rest = _values(layer)
        return new_carry, (ys, new_rest)

    carry, (ys, new_rest) = ctx.access.scan(group.name, body, args[ci], (tuple(args[i] for i in xs_at), rest))
    ctx.record[group.name] = "per layer"
    with params_untouched():
        state = nnx.state(stack, nnx.Not(nnx.Param))
    for p, v in nnx.to_flat_state(state):
        if not isinstance(v, nnx.RngState):
            v.set_value(new_rest[path_str(p)])
    nnx.update(stack, state)
    return _join_out(carry, ys, out_axes)


def _values(module) -> dict:
    """``{"a/b": value}`` of a module's non-parameter variables."""
    return {path_str(p): v.get_value() for p, v in non_params(module)}


def _split_out(out, out_axes):
    if out_axes is nnx.Carry:
        return out, ()
    if (
        not isinstance(out_axes, tuple)
        or [a is nnx.Carry for a in out_axes].count(True) != 1
        or any(a is not nnx.Carry and a != 0 for a in out_axes)
    ):
        raise NotImplementedError(
            f"inside the QSDP step, qsdp_jax.nnx.scan takes out_axes nnx.Carry or a tuple of one "
            f"nnx.Carry and 0s; got {out_axes}"
        )
    carry = out[[a is nnx.Carry for a in out_axes].index(True)]
    ys = tuple(o for o, a in zip(out, out_axes) if a is not nnx.Carry)
    return carry, ys


def _join_out(carry, ys, out_axes):
    if out_axes is nnx.Carry:
        return carry
    it = iter(ys)
    return tuple(carry if a is nnx.Carry else next(it) for a in out_axes)
