"""One dispatch for the hot-path kernels: Pallas on TPU, the jnp reference on CPU and GPU.

Modes (``QSDPConfig.kernels``):

* ``"auto"`` (default): ``"pallas"`` in a process whose default backend is a TPU,
  ``"reference"`` otherwise (so CPU and GPU runs trace no kernel at all). Not Pallas on GPU:
  on an H200 (``experiments/results/kernels_h200.json``, ``kernel_check_h200.json``) XLA's
  fusion of the reference was within 10% of the Triton kernels or faster in every pass
  (within 10% in 4 of 12, ahead by more in 8, against a copy timed beside each), and the kernels
  differed from the reference in 29 of 138 bit-equality checks. TPU is unmeasured.
* ``"pallas"``: ``lax.platform_dependent`` picks per lowering platform: the Triton kernel on
  CUDA, the Mosaic kernel on TPU, the caller's jnp reference on CPU and anywhere else (the CPU
  keeps its packing boundary and other XLA:CPU specifics). A jit lowered for several platforms
  carries all branches; ``jax.export`` from a CPU host to ``["cuda"]``/``["tpu"]`` uses this.
* ``"reference"``: the jnp reference everywhere (to rule the kernels out, or to compare).
* ``"interpret"``: the Pallas kernels in interpret mode on any backend (tests on CPU).

The GPU lowering is Triton, deliberately: it runs on A100 and H100 alike, while Mosaic GPU
(JAX's default for ``pallas_call`` on CUDA) needs Hopper or newer. Buckets whose group count
``bucket // 8`` is not a power of 2 (Triton's tensor-size rule) use the reference on CUDA.

The TPU lowering is Mosaic, with a layout of its own (:mod:`qsdp_jax.kernels._tpu`: lane-dense
128-element rows, the bytes packed on the MXU), compiled by libtpu for v4, v5e, v5p and v6e at
every bit width (``tests/test_tpu_compile.py``; the kernels' bits are checked against the
reference in interpret mode, as ``"tpu_interpret"``). Buckets that are not a multiple of 128,
and sums over more senders than the kernel's VMEM holds (more than 128), use the reference on TPU. Their speed on a TPU is unmeasured (no TPU has been lent to us).
"""

from __future__ import annotations

from typing import Callable

import jax
from jax import lax

from qsdp_jax.config import KERNEL_MODES
from qsdp_jax.kernels import _pallas as kp


def check_mode(mode: str):
    """Refuse an unknown kernels mode.

    Args:
      mode: a ``QSDPConfig.kernels`` value: ``"auto"``, ``"pallas"``, ``"reference"`` or
        ``"interpret"`` (``KERNEL_MODES``).

    Raises:
      ValueError: ``mode`` is not one of them.
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels={mode!r} is invalid: must be one of {KERNEL_MODES}")


def select(mode: str, reference: Callable, kernel: Callable, *args, bucket: int, tpu_fits: bool = True):
    """``reference(*args)`` or ``kernel(*args, target=...)`` as ``mode`` and the platform say.

    ``args`` are arrays only (``lax.platform_dependent`` passes them to every branch); bind
    static arguments into the callables. Both must return the same pytree of shapes/dtypes. A
    kernel runs under :func:`with_reference_vjp` (its gradient is the reference's).

    Args:
      mode: ``QSDPConfig.kernels`` (see the module docstring).
      reference: the jnp reference, ``reference(*args)``.
      kernel: the Pallas kernel, ``kernel(*args, target=target)``.
      *args: the arrays both take.
      bucket: the bucket size; on CUDA a bucket whose group count ``bucket // 8`` is not a
        power of 2 uses the reference, on TPU a bucket that is not a multiple of 128.
      tpu_fits: False where the TPU kernel's smallest block would not fit its VMEM for these
        arguments (the sum over more than 128 senders, ``_tpu.sum_fits``): the reference on TPU.

    Returns:
      What the chosen callable returns.

    Raises:
      ValueError: an unknown ``mode``.
    """
    check_mode(mode)
    if mode == "auto":
        mode = "pallas" if jax.default_backend() == "tpu" else "reference"
    if mode == "reference":
        return reference(*args)
    if mode == "interpret":
        return with_reference_vjp(reference, kernel, "interpret")(*args)

    def on(target):
        return with_reference_vjp(reference, kernel, target)

    cuda = on("triton") if kp.triton_ok(bucket) else reference
    tpu = on("mosaic_tpu") if kp.tpu_ok(bucket) and tpu_fits else reference
    return lax.platform_dependent(*args, cpu=reference, cuda=cuda, tpu=tpu, default=reference)


def with_reference_vjp(reference: Callable, kernel: Callable, target: str) -> Callable:
    """``kernel(*args, target=target)`` under a ``custom_vjp`` whose backward pass is the
    reference's VJP: Pallas kernels have no autodiff of their own, and a gradient taken
    through a kernel then equals the one taken through the reference.

    Args:
      reference: the jnp reference, ``reference(*args)``.
      kernel: the Pallas kernel, ``kernel(*args, target=target)``.
      target: the Pallas lowering (``_pallas.TARGETS``).

    Returns:
      ``run(*args)``: the kernel's result, differentiable through the reference.
    """

    @jax.custom_vjp
    def run(*args):
        return kernel(*args, target=target)

    def fwd(*args):
        return kernel(*args, target=target), args

    def bwd(args, ct):
        return jax.vjp(reference, *args)[1](ct)

    run.defvjp(fwd, bwd)
    return run
