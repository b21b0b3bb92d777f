"""A kernel that a compiler refuses, said in our words: which kernel, which chip, the way out.

XLA reports a Pallas kernel that does not compile as its own error (``Mosaic failed to compile
TPU kernel: ...``, ``RESOURCE_EXHAUSTED: ... Ran out of memory in memory space vmem ...
qsdp_quantize_pack_stochastic_4b``, a Triton failure), raised from deep inside the first call of
a jitted step. :func:`kernel_failures_explained`
turns such an error into a :class:`KernelCompileError` that names the kernel, the device kind
and ``QSDPConfig(kernels="reference")``, with XLA's error as its cause; other errors pass
unchanged.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

_NAME = re.compile(r"qsdp_[a-z]+(?:_[a-z0-9]+)*")
_KERNEL_WORDS = re.compile(r"vmem|mosaic|triton|pallas", re.IGNORECASE)


class KernelCompileError(RuntimeError):
    """A Pallas kernel of ours that the target's compiler refused (XLA's error is the cause)."""


def explain(err: BaseException, device_kind: str) -> KernelCompileError | None:
    """The :class:`KernelCompileError` for ``err`` if it is a kernel's compile failure, else None.

    Args:
      err: the exception a jitted step's compile raised.
      device_kind: the kind of device it was compiled for (``jax.Device.device_kind``).

    Returns:
      The explained error, or None when ``err`` is not a failure of a Pallas kernel.
    """
    text = str(err)
    found = _NAME.search(text)
    if "Mosaic failed to compile" not in text and not (found and _KERNEL_WORDS.search(text)):
        return None
    kernel = f"the Pallas kernel {found.group(0)}" if found else "a Pallas kernel of the step"
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return KernelCompileError(
        f"{kernel} did not compile for {device_kind}: {first[:300].rstrip('.')}. The way out: "
        "QSDPConfig(kernels='reference') runs the jnp reference, which computes the same bits; "
        "please report the kernel, the chip and this message"
    )


@contextlib.contextmanager
def kernel_failures_explained(device_kind: str) -> Iterator[None]:
    """Re-raise a kernel's compile failure inside the block as a :class:`KernelCompileError`.

    Args:
      device_kind: the kind of device the block compiles for, named in the message.

    Raises:
      KernelCompileError: the block raised a kernel's compile failure (from it).
    """
    try:
        yield
    except Exception as err:
        explained = explain(err, device_kind)
        if explained is None:
            raise
        raise explained from err
