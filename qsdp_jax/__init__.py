"""qsdp_jax: quantized fully-sharded data-parallel training (QSDP) for JAX.

The public API is what this module exports, and the modules it names: ``qsdp_jax.nnx`` (the Flax
NNX front door), ``qsdp_jax.optim``, ``qsdp_jax.checkpoint``, ``qsdp_jax.distributed``,
``qsdp_jax.comm`` (bytes on the wire), ``qsdp_jax.collectives`` (the quantized collectives, for
people who build their own steps) and ``qsdp_jax.kernels``. Everything under ``qsdp_jax._src`` is
internal. The docs (``docs/``) walk through it; ``docs/design.md`` states the invariants.
"""

from qsdp_jax.version import __version__

from qsdp_jax import checkpoint, collectives, comm, distributed, kernels, nnx, optim
from qsdp_jax.access import LocalParams, ParamAccess
from qsdp_jax.checkpoint import CheckpointDamaged, CheckpointMismatch, Checkpointer
from qsdp_jax.config import QSDPConfig
from qsdp_jax.sharding import make_mesh
from qsdp_jax.layout import ParamLayout
from qsdp_jax.train import (
    TrainState,
    abstract_train_state,
    gather_params,
    init_train_state,
    make_eval_step,
    make_train_step,
)
from qsdp_jax.watchdog import StepWatchdog
from qsdp_jax._src.step.weighted_mean import LocalMeanWarning, WeightedMean

__all__ = [
    "CheckpointDamaged",
    "CheckpointMismatch",
    "Checkpointer",
    "LocalMeanWarning",
    "LocalParams",
    "ParamAccess",
    "ParamLayout",
    "QSDPConfig",
    "StepWatchdog",
    "TrainState",
    "WeightedMean",
    "__version__",
    "abstract_train_state",
    "checkpoint",
    "collectives",
    "comm",
    "distributed",
    "gather_params",
    "init_train_state",
    "kernels",
    "make_eval_step",
    "make_mesh",
    "make_train_step",
    "nnx",
    "optim",
]
