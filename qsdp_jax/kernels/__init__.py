"""Pallas kernels for QSDP's quantize / pack hot path, and the dispatch that picks them.

See :mod:`qsdp_jax.kernels.dispatch` for when a kernel runs, :mod:`.quantize` and
:mod:`.dequantize` for the kernels (each bit-identical to its jnp reference in
:mod:`qsdp_jax._src.quant.quantizers`).
"""

from qsdp_jax.kernels.compile_errors import KernelCompileError
from qsdp_jax.kernels.dequantize import unpack_dequantize, unpack_dequantize_sum
from qsdp_jax.kernels.dispatch import KERNEL_MODES, check_mode, select
from qsdp_jax.kernels.quantize import grid_pack, project, quantize_pack, snap

__all__ = [
    "KERNEL_MODES",
    "KernelCompileError",
    "check_mode",
    "grid_pack",
    "project",
    "quantize_pack",
    "select",
    "snap",
    "unpack_dequantize",
    "unpack_dequantize_sum",
]
