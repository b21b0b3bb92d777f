"""The NNX front door's checks, with leaves named as the NNX user knows them: a state that does
not fit the module, a loss function's result, a module in eval mode given to a train step.

Used by :mod:`qsdp_jax.nnx` (``init_state``, ``update``, ``TrainStep``); the model-independent
checks (donated state, mesh, parameter values) are :mod:`qsdp_jax._src.step.guards`, which these
labels feed.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from qsdp_jax._src.quant import weight_codes as wc
from qsdp_jax import train
from qsdp_jax._src.nnx.tree import ModelDef, state_mismatches
from qsdp_jax._src.step.weighted_mean import WeightedMean, check_weighted

INT_HINT = (
    "hold integer or boolean arrays in an nnx.Variable that is not an nnx.Param "
    "(model state, carried by the step), or outside the module"
)


def param_label(path) -> str:
    """``nnx.Param blocks/0/kernel``: a leaf of the groups dict by its module path."""
    return "nnx.Param " + "/".join(str(getattr(k, "key", k)) for k in path)


def state_label(path) -> str:
    """A leaf of a TrainState named as the NNX user knows it."""
    field, rest = path[0].name, path[1:]
    if field == "params":
        return f"state's {param_label(rest)}"
    if field == "model_state":
        return f"state's model state {rest[0].key}"
    if field == "opt_state":
        return f"state's optimizer state {jax.tree_util.keystr(rest)}"
    return f"state's {field}"


def check_fits(mdef: ModelDef, state: train.TrainState) -> None:
    """A clear error for a state (from init_state) of another model than ``mdef``'s."""
    if not isinstance(state, train.TrainState):
        raise TypeError(f"expected the TrainState from qsdp_jax.nnx.init_state, got {type(state).__name__}")
    have = tuple(g.name for g in state.layout.groups)
    want = tuple(g.name for g in mdef.groups)
    stacked = tuple(g.name for g in state.layout.groups if g.stacked)
    if have != want or stacked != mdef.stacked:
        raise ValueError(
            f"the state's groups {have} (stacked {stacked}) are not this model's {want} "
            f"(stacked {mdef.stacked}): make the state with qsdp_jax.nnx.init_state from "
            "the same model, with the same stacked="
        )
    config = wc.state_config(state.opt_state)  # code-held weights: compare what they decode to
    params = wc.values_like(state.layout) if config is not None and wc.holds_codes(config) else state.params
    bad = state_mismatches(mdef, params, state.model_state)
    if bad:
        more = f"; and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise ValueError(
            f"the state does not fit this module (was it made from another model?): "
            f"{'; '.join(bad[:4])}{more}. Make the state with qsdp_jax.nnx.init_state from this module"
        )


def split_loss(out, has_aux: bool):
    """``(loss, aux)`` of a ``loss_fn`` result (``aux`` None without ``has_aux``); a
    ``ValueError`` unless it is a scalar floating loss (or ``(loss, aux)`` with ``has_aux``)."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"with has_aux=True, loss_fn must return (loss, aux), got {type(out).__name__}")
        loss, aux = out
    else:
        loss, aux = out, None
    if isinstance(out, tuple) and not has_aux:
        raise ValueError("loss_fn returned a tuple: return a scalar loss, or (loss, aux) with has_aux=True")
    if isinstance(loss, WeightedMean):
        check_weighted(loss)
        return loss, aux
    floating = hasattr(loss, "dtype") and jnp.issubdtype(jnp.result_type(loss), jnp.floating)
    if not floating or jnp.shape(loss) != ():
        raise ValueError(
            f"loss_fn must return a scalar floating loss (the mean over the local batch) or a "
            f"qsdp_jax.WeightedMean; got "
            f"shape {jnp.shape(loss)} dtype {jnp.result_type(loss)}"
        )
    return loss, aux


def warn_mode(differences: list[str]) -> None:
    """Warn that a train step runs a module in training mode that is in eval mode now
    (``differences``: its attributes that differ, from ``nnx_tree.mode_differences``).

    Called from ``TrainStep.__init__``: the warning points at the caller of ``make_train_step``.
    """
    if differences:
        more = f" and {len(differences) - 3} more" if len(differences) > 3 else ""
        warnings.warn(
            f"the module is in eval mode ({', '.join(differences[:3])}{more}) but this train step "
            "runs it in training mode, as model.train() sets it (dropout on, batch statistics "
            "updated); pass mode=None to train the module with its attributes as they are now",
            stacklevel=4,
        )
