"""qsdp_jax: quantized fully-sharded data-parallel training (QSDP) for JAX.

The public API; see README.md for a walk-through and ``docs/design.md`` for the invariants.
"""

from qsdp_jax.version import __version__  # noqa: F401  (written once, in qsdp_jax/version.py)

from qsdp_jax import optim  # noqa: F401  (``qsdp_jax.optim.qsdp``)
from qsdp_jax import checkpoint  # noqa: F401  (``qsdp_jax.checkpoint.Checkpointer``)
from qsdp_jax import collectives  # noqa: F401  (``qsdp_jax.collectives``: the quantized collectives)
from qsdp_jax import comm  # noqa: F401  (``qsdp_jax.comm.comm_report``: bytes per collective)
from qsdp_jax import distributed  # noqa: F401  (``qsdp_jax.distributed.initialize``)
from qsdp_jax import kernels  # noqa: F401  (``qsdp_jax.kernels``: Pallas hot path)
from qsdp_jax import nnx  # noqa: F401  (the Flax NNX front door: ``qsdp_jax.nnx.init_state``)
from qsdp_jax import rotation  # noqa: F401  (``QSDPConfig.grad_rotation``: blockwise Hadamard)
from qsdp_jax import policy  # noqa: F401  (per-leaf bits: ``QSDPConfig.bit_policy``'s paths and patterns)
from qsdp_jax.access import LocalParams, ParamAccess
from qsdp_jax.collectives import (
    GatherSpec,
    all_gather_fp,
    make_gather,
    quantized_all_gather,
    quantized_reduce_scatter,
    reduce_scatter_fp,
)
from qsdp_jax.checkpoint import CheckpointMismatch, Checkpointer
from qsdp_jax.config import QSDPConfig
from qsdp_jax.hierarchy import (
    TwoLevelSpec,
    cross_group_all_reduce,
    two_level_all_gather,
    two_level_reduce_scatter,
)
from qsdp_jax.quantizers import QTensor, dequantize, pack_bits, quantize, unpack_bits
from qsdp_jax.sharding import ParamLayout, make_mesh
from qsdp_jax.watchdog import StepWatchdog
from qsdp_jax.train import (
    ShardedParams,
    TrainState,
    abstract_train_state,
    gather_params,
    init_train_state,
    make_eval_step,
    make_train_step,
)

__all__ = [
    "CheckpointMismatch",
    "Checkpointer",
    "GatherSpec",
    "LocalParams",
    "ParamAccess",
    "ParamLayout",
    "QSDPConfig",
    "QTensor",
    "ShardedParams",
    "StepWatchdog",
    "TrainState",
    "TwoLevelSpec",
    "abstract_train_state",
    "all_gather_fp",
    "checkpoint",
    "collectives",
    "comm",
    "cross_group_all_reduce",
    "dequantize",
    "distributed",
    "gather_params",
    "init_train_state",
    "kernels",
    "make_eval_step",
    "make_gather",
    "make_mesh",
    "make_train_step",
    "nnx",
    "optim",
    "policy",
    "pack_bits",
    "quantize",
    "quantized_all_gather",
    "quantized_reduce_scatter",
    "reduce_scatter_fp",
    "two_level_all_gather",
    "two_level_reduce_scatter",
    "unpack_bits",
]
